#!/usr/bin/env bash
# The main job of README.md: a local cluster on loopback from a synthetic checkpoint with router
# skew. Starts router-svc, expert-svc shards and attention-svc on free ports, runs the load
# generator for a bounded time, prints throughput, latency and imbalance, calls Rebalance
# (Quantile Balancing) and runs the traffic again until MaxVio is within 1.5x of the window's
# noise floor (at most four times), prints each step, then stops every process (also on Ctrl-C).
# Usage: scripts/run.sh [--preset mid|tiny|k3] [--shards N] [--duration S] [--concurrency C]
#                       [--tokens T] [--seed N] [--skew X] [--reply_mode per_pair|partial_sum]
#                       [--in_process]   (also time the in-process layer, optimized and reference)
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=mid
SHARDS=2
DURATION=10
CONCURRENCY=4
TOKENS=64
SEED=1
SKEW=1.0
REPLY_MODE=per_pair
IN_PROCESS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET=$2; shift 2 ;;
    --shards) SHARDS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --skew) SKEW=$2; shift 2 ;;
    --reply_mode) REPLY_MODE=$2; shift 2 ;;
    --in_process) IN_PROCESS=1; shift ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/run.sh: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
# A bad reply mode is said now, not after the shards have loaded.
case "$REPLY_MODE" in
  per_pair|partial_sum) ;;
  *) echo "scripts/run.sh: --reply_mode '$REPLY_MODE': expected per_pair or partial_sum" >&2; exit 2 ;;
esac
if [ "$PRESET" = k3 ]; then
  # One K3 layer runs ~30-100 tokens/s on two cores: smaller batches, longer phases.
  [ "$TOKENS" = 64 ] && TOKENS=16
  [ "$DURATION" = 10 ] && DURATION=30
  [ "$CONCURRENCY" = 4 ] && CONCURRENCY=2
fi
scripts/setup.sh
BUILD=${MOE_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja >/dev/null
cmake --build "$BUILD" --target moe-tool moe-cli router-svc expert-svc attention-svc
CKPT=${MOE_CKPT_DIR:-out/ckpt-$PRESET-seed$SEED-skew$SKEW}
if [ ! -f "$CKPT/config.json" ]; then
  if [ "$PRESET" = k3 ]; then
    echo "generating one K3 layer: about 15.8 GB on disk, a few minutes"
  fi
  rm -rf "$CKPT" "$CKPT.tmp"
  mkdir -p "$(dirname "$CKPT")"
  "$BUILD/services/moe-tool" synth --config "$PRESET" --out "$CKPT.tmp" --seed "$SEED" --skew "$SKEW"
  mv "$CKPT.tmp" "$CKPT"
fi
if [ "$IN_PROCESS" = 1 ]; then
  for BACKEND in cpu ref; do
    if [ "$BACKEND" = ref ] && [ "$PRESET" = k3 ] && [ "$TOKENS" -gt 16 ]; then
      echo "(skipping the reference for k3 above 16 tokens: about 1 s per token)"
      continue
    fi
    "$BUILD/services/moe-tool" forward --checkpoint "$CKPT" --tokens "$TOKENS" --seed 7 \
      --backend "$BACKEND" --repeat 2
  done
fi
mkdir -p out
exec "$BUILD/bin/moe-cli" cluster --checkpoint "$CKPT" --shards "$SHARDS" \
  --duration "$DURATION" --concurrency "$CONCURRENCY" --tokens "$TOKENS" \
  --cluster_reply_mode "$REPLY_MODE" --work_dir "out/cluster-logs"
