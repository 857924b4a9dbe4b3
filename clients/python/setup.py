"""Builds moe_client with its generated message classes (moe_client/_proto): protoc runs here,
at build time, on the repository's proto/ (two directories up), never when the client runs."""
import glob
import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


class BuildWithProtos(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "moe_client", "_proto")
        files = sorted(glob.glob(os.path.join(PROTO, "moe", "v1", "*.proto")) +
                       glob.glob(os.path.join(PROTO, "inference", "*.proto")))
        if not files:
            raise SystemExit(f"moe_client: no .proto files under {PROTO}")
        os.makedirs(out, exist_ok=True)
        subprocess.run(["protoc", f"-I{PROTO}", f"--python_out={out}"] + files, check=True)
        open(os.path.join(out, "__init__.py"), "w").close()


setup(cmdclass={"build_py": BuildWithProtos})
