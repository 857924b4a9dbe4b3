#!/usr/bin/python3
"""The model loop (examples/model_loop.py) against a real local cluster serving every MoE layer
of a tiny checkpoint, checked against two independent stand-ins for the MoE blocks:

1. the in-process C++ layer (`moe-tool forward` on the same checkpoint, layer and input), and
2. the NumPy reference (tests/reference/moe_reference.py: layer_forward),

each driving the same decoder with the same seed. Asserted: the greedy tokens and every step's
logits equal bit for bit; the decode is not degenerate (the MoE blocks change the logits, the
tokens vary); the per-call split adds up to the call; the benchmark path writes its table and a
real gnuplot PNG.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.join(_HERE, "..", "..")
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(0, os.path.join(_ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, os.path.join(_HERE, "..", "reference"))
import model_loop  # noqa: E402
from moe_client import cluster_args  # noqa: E402
from moe_client.torch_module import from_bf16_bits, to_bf16_bits  # noqa: E402
from cluster_helpers import stop, wait_for  # noqa: E402
from moe_reference import Checkpoint, layer_forward, read_safetensors  # noqa: E402

LAYERS = [1, 2]  # every MoE layer of the tiny preset (3 layers, the first dense)
BATCH, PROMPT, STEPS = 4, 6, 8


def from_bits(bits, shape):
    return from_bf16_bits(bits).float().reshape(shape)


def write_safetensors(path, name, bits):
    header = json.dumps({name: {"dtype": "BF16", "shape": list(bits.shape),
                                "data_offsets": [0, bits.nbytes]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + np.ascontiguousarray(bits).tobytes())


class MoeToolBlock:
    """The in-process C++ layer: moe-tool forward on the same checkpoint and input."""

    def __init__(self, moe_tool, ckpt, layer, work):
        self.moe_tool, self.ckpt, self.layer, self.work = moe_tool, ckpt, layer, work

    def __call__(self, x):
        src, dst = os.path.join(self.work, "x.safetensors"), os.path.join(self.work, "y.safetensors")
        write_safetensors(src, "x", to_bf16_bits(x))
        subprocess.run([self.moe_tool, "forward", "--checkpoint", self.ckpt, "--layer",
                        str(self.layer), "--input", src, "--output", dst], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        tensors, _ = read_safetensors(dst)
        return from_bits(tensors["out"], x.shape)


class NumpyBlock:
    """The independent NumPy reference of the layer."""

    def __init__(self, ck, layer):
        self.ck, self.layer = ck, layer

    def __call__(self, x):
        out, _, _ = layer_forward(self.ck, self.layer, to_bf16_bits(x))
        return from_bits(out, x.shape)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-cli", required=True)
    ap.add_argument("--moe-tool", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    ckpt = os.path.join(args.work, "ckpt-tiny")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        subprocess.run([args.moe_tool, "synth", "--config", "tiny", "--out", ckpt, "--seed", "5",
                        "--skew", "1.0", "--layers", ",".join(map(str, LAYERS))], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    cluster_dir = tempfile.mkdtemp(prefix="cluster-", dir=args.work)
    cj = os.path.join(cluster_dir, "cluster.json")
    up = subprocess.Popen([args.moe_cli, "up", "--checkpoint", ckpt, "--work_dir", cluster_dir,
                           "--threads", "1", "--layers", ",".join(map(str, LAYERS)),
                           "--max_seconds", "280"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cluster = wait_for("cluster.json", lambda: os.path.exists(cj) and json.load(open(cj)), 120)
        # moe-cli up's default: mutual TLS, this client with the cluster's client certificate.
        assert "tls" in cluster, "moe-cli up ran without TLS"
        where = cluster_args(cj)
        attention = where["attention"]
        hidden = Checkpoint(ckpt).cfg["hidden_size"]

        remote = model_loop.remote_blocks(attention, LAYERS, credentials=where["credentials"])
        assert [b.layer for b in remote] == LAYERS
        got_tokens, got_logits, log = model_loop.run(
            model_loop.Decoder(hidden, remote, seed=3), BATCH, PROMPT, STEPS, seed=3)
        assert got_tokens.shape == (BATCH, STEPS), got_tokens.shape
        assert len(log.steps) == STEPS and all(len(s["calls"]) == len(LAYERS) for s in log.steps)

        inproc = [MoeToolBlock(args.moe_tool, ckpt, l, args.work) for l in LAYERS]
        want_tokens, want_logits, _ = model_loop.run(
            model_loop.Decoder(hidden, inproc, seed=3), BATCH, PROMPT, STEPS, seed=3)
        assert torch.equal(got_tokens, want_tokens), (got_tokens, want_tokens)
        assert same_bits(got_logits, want_logits), "logits differ from the in-process layer"

        ck = Checkpoint(ckpt)
        ref_tokens, ref_logits, _ = model_loop.run(
            model_loop.Decoder(hidden, [NumpyBlock(ck, l) for l in LAYERS], seed=3), BATCH, PROMPT,
            STEPS, seed=3)
        assert torch.equal(got_tokens, ref_tokens), (got_tokens, ref_tokens)
        assert same_bits(got_logits, ref_logits), "logits differ from the NumPy reference"

        # Not degenerate: the MoE blocks change the logits, and the decode is not one token.
        zero = [lambda x: torch.zeros_like(x) for _ in LAYERS]
        _, zero_logits, _ = model_loop.run(model_loop.Decoder(hidden, zero, seed=3), BATCH, PROMPT,
                                           STEPS, seed=3)
        assert not torch.equal(zero_logits, got_logits), "the MoE blocks changed nothing"
        assert len(set(got_tokens.flatten().tolist())) > BATCH, got_tokens

        # The split of each call adds up to the call, and the service reported its stages.
        for s in log.steps:
            for c in s["calls"]:
                assert c["node"] > 0 and c["experts"] >= 0 and c["hop"] >= 0, c
                assert abs(c["node"] + c["experts"] + c["hop"] - c["wall"]) < 1e-6 or \
                    c["node"] + c["experts"] > c["wall"], c
            assert s["local"] > 0 and s["local"] < s["wall"], s

        # The benchmark path: the table's rows and a real PNG from gnuplot.
        rows = model_loop.bench(model_loop.Decoder(hidden, remote, seed=3), [1, 4], 4, 4, 3, 92)
        assert [r["batch"] for r in rows] == [1, 4] and all(r["layers"] == 2 for r in rows)
        for r in rows:
            assert abs(r["projected_step_ms"] - r["step_ms"] / 2 * 92) < 1e-6 * r["step_ms"] * 46
        text = model_loop.table(rows, 92)
        assert text.count("\n") == 3, text
        png = os.path.join(args.work, "loop.png")
        model_loop.plot(rows, png, "model loop test")
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
        for b in remote:
            b.close()
    finally:
        stop(up)
    print(f"model loop: tiny, {len(LAYERS)} MoE layers, B = {BATCH}, {STEPS} steps: tokens and "
          "logits bit-exact with the in-process layer and the NumPy reference")
    print(text)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
