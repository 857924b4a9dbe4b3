#!/usr/bin/env bash
# The wheel the build makes (build/python/moe_client-*.whl, cmake/MoePythonWheel.cmake),
# installed as a user with no package index does it: `pip install <wheel>` with no flag, into a
# fresh virtual environment that sees Debian's grpcio, protobuf and numpy
# (--system-site-packages), with the index pointed at a closed loopback port so that any attempt
# to reach one fails the install. Its message classes come from the build (moe_client/_proto, no
# protoc when it runs: PATH without protoc, no proto/ next to it), and it answers from a
# directory outside the checkout against a local cluster, bit for bit the in-process layer.
# Usage: python_package_test.sh SOURCE_DIR MOE_CLI MOE_TOOL WORK_DIR WHEEL
set -euo pipefail
trap 'echo "FAIL: line $LINENO: $BASH_COMMAND"' ERR
SRC=$1
MOE_CLI=$2
MOE_TOOL=$3
WORK=$4
WHEEL=$5
rm -rf "$WORK" && mkdir -p "$WORK"
/usr/bin/python3 -m venv --system-site-packages "$WORK/venv"
# No flag; an index that cannot be reached (a closed port on loopback, no retries).
env PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_RETRIES=0 PIP_TIMEOUT=2 \
  "$WORK/venv/bin/pip" install --quiet "$WHEEL" >"$WORK/pip.log" 2>&1 ||
  { cat "$WORK/pip.log"; exit 1; }
"$WORK/venv/bin/pip" show moe-client >"$WORK/show.txt"
grep -q "^Version: 0.1.0" "$WORK/show.txt"
"$MOE_TOOL" synth --config tiny --out "$WORK/ckpt" --single_file >/dev/null
"$MOE_TOOL" forward --checkpoint "$WORK/ckpt" --tokens 8 --seed 3 --output "$WORK/ref.safetensors" \
  >/dev/null
"$MOE_CLI" up --checkpoint "$WORK/ckpt" --work_dir "$WORK/cluster" --threads 1 --max_seconds 120 \
  >"$WORK/up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null || true; echo "FAIL: line $LINENO: $BASH_COMMAND"' ERR
for _ in $(seq 1 240); do  # bounded: 60 s
  [ -f "$WORK/cluster/cluster.json" ] && break
  sleep 0.25
done
mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
# No protoc on PATH, no proto/ to generate from: the bundled classes must do.
env -i HOME="$WORK" PATH="$WORK/venv/bin" MOE_CLIENT_PROTO_DIR=/nonexistent \
  "$WORK/venv/bin/python" - "$WORK/cluster/cluster.json" "$WORK/ref.safetensors" \
  "$SRC/tests/reference" <<'PY'
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[3])  # the test's safetensors reader only
from moe_reference import read_safetensors
import moe_client
from moe_client import Client, cluster_args
pb = moe_client.load_protos()
assert "/site-packages/moe_client/_proto" in pb.source, pb.source
ref, _ = read_safetensors(sys.argv[2])
# moe-cli up's default: mutual TLS; cluster.json names this client's certificate.
assert cluster_args(sys.argv[1])["credentials"] is not None, "moe-cli up ran without TLS"
with Client(**cluster_args(sys.argv[1])) as c:
    r = c.forward(ref["x"])
assert np.array_equal(r.out_bf16, ref["out"]), "the installed client's answer differs"
print(f"installed moe_client {moe_client.__file__}: classes from {pb.source}; forward bit-exact")
PY
kill "$UP"; wait "$UP" 2>/dev/null || true
echo PASS
