#!/usr/bin/env bash
# The installed C++ SDK, as a user gets it: `cmake --install` of this build into a fresh prefix,
# a project outside the repository (sdk_consumer/) configured with find_package(MoeClient) and
# built, its binary free of gRPC's reflection library, then run against a local cluster started
# from the installed moe-cli.
# Usage: sdk_install_test.sh BUILD_DIR MOE_TOOL WORK_DIR
set -euo pipefail
trap 'echo "FAIL: line $LINENO: $BASH_COMMAND"' ERR
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$1
MOE_TOOL=$2
WORK=$3
rm -rf "$WORK" && mkdir -p "$WORK"
cmake --install "$BUILD" --prefix "$WORK/prefix" >"$WORK/install.log"
test -f "$WORK/prefix/lib/cmake/MoeClient/MoeClientConfig.cmake"
# Headers under the project's own folder only (generated etcd/, inference/, moe/ included).
test "$(ls "$WORK/prefix/include")" = "moe-serving"
test -f "$WORK/prefix/include/moe-serving/inference/grpc_inference.pb.h"
test -f "$WORK/prefix/include/moe-serving/services/client/moe_client.h"
cmake -S "$HERE/sdk_consumer" -B "$WORK/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" \
  >"$WORK/consumer-configure.log"
cmake --build "$WORK/consumer" >"$WORK/consumer-build.log"
if ldd "$WORK/consumer/consumer" | grep -q reflection; then
  echo "FAIL: the SDK pulls in gRPC's reflection library"; exit 1
fi
"$MOE_TOOL" synth --config tiny --out "$WORK/ckpt" --single_file >/dev/null
"$WORK/prefix/bin/moe-cli" up --checkpoint "$WORK/ckpt" --work_dir "$WORK/cluster" --threads 1 \
  --max_seconds 120 >"$WORK/up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null || true; echo "FAIL: line $LINENO: $BASH_COMMAND"' ERR
for _ in $(seq 1 240); do  # bounded: 60 s
  [ -f "$WORK/cluster/cluster.json" ] && break
  sleep 0.25
done
# The installed moe-cli runs the installed services (its own prefix), not the build tree's.
for b in router-svc expert-svc attention-svc; do
  pgrep -f "^$WORK/prefix/bin/$b " >/dev/null || { echo "FAIL: $b not run from the prefix"; exit 1; }
done
# moe-cli up's default is mutual TLS on its own CA: cluster.json names the client's files.
read -r ATTENTION CA CERT KEY < <(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); \
t=c['tls']; print(c['attention'], t['ca_file'], t['cert_file'], t['key_file'])" \
  "$WORK/cluster/cluster.json")
if "$WORK/consumer/consumer" "$ATTENTION" >/dev/null 2>&1; then
  echo "FAIL: a plaintext client was served by moe-cli up's default cluster"; exit 1
fi
OUT=$("$WORK/consumer/consumer" "$ATTENTION" "$CA" "$CERT" "$KEY")
echo "$OUT"
kill "$UP"; wait "$UP" 2>/dev/null || true
grep -q "model tiny: hidden 128, 16 experts, top 4, layer 1; out \[4, 128\]" <<<"$OUT"
echo PASS
