#!/usr/bin/env bash
# The model loop's benchmark (examples/model_loop.py --bench): a mid checkpoint with every MoE
# layer (1, 2, 3), one local cluster serving all of them, greedy decoding of B sequences for
# B = 1, 4, 16, 64; prints the table (per decode step: local work, the attention node's own
# work, the expert tier, the gRPC hop; tokens/s, and projected to 92 MoE layers) and writes a
# gnuplot PNG. Called by scripts/bench.sh --model_loop; about 1 min on 2 cores.
# Usage: tests/bench/model_loop_bench.sh BUILD_DIR OUT_DIR [model_loop.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=$1
OUT=$2
shift 2
mkdir -p "$OUT"
CKPT="$OUT/mid-layers-1-3"
if [ ! -f "$CKPT/config.json" ]; then
  "$BUILD/services/moe-tool" synth --config mid --out "$CKPT" --seed 1 --skew 1.0 --layers 1,2,3
fi
WORK=$(mktemp -d "$OUT/loop-cluster.XXXXXX")
"$BUILD/bin/moe-cli" up --checkpoint "$CKPT" --work_dir "$WORK" --layers 1,2,3 \
  --max_seconds 900 >/dev/null 2>"$WORK/up.err" &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  [ -s "$WORK/cluster.json" ] && break
  kill -0 $UP 2>/dev/null || { cat "$WORK/up.err"; exit 1; }
  sleep 0.5
done
lscpu | grep -E "^Model name|^CPU\(s\)|^CPU family|^Model:"
/usr/bin/python3 examples/model_loop.py --cluster "$WORK/cluster.json" --bench 1,4,16,64 --steps 17 \
  --plot "$OUT/model-loop.png" --json "$OUT/model-loop.json" "$@"
echo "wrote $OUT/model-loop.png and $OUT/model-loop.json"
