#!/usr/bin/env bash
# The main job of README.md. For now (numerics core + CPU kernels): generate a synthetic
# K3-format checkpoint of the chosen preset with router skew, run one MoE layer forward with the
# optimized CPU backend and with the scalar reference, and print timing per stage and a
# checksum of each output. The serving issue turns this into the local cluster.
# Usage: scripts/run.sh [--preset mid|tiny|k3] [--tokens N] [--seed N] [--skew X]
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=mid
TOKENS=64
SEED=1
SKEW=1.0
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --skew) SKEW=$2; shift 2 ;;
    *) echo "usage: scripts/run.sh [--preset mid|tiny|k3] [--tokens N] [--seed N] [--skew X]"; exit 2 ;;
  esac
done
scripts/setup.sh
BUILD=${MOE_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja >/dev/null
cmake --build "$BUILD" --target moe-tool
CKPT=${MOE_CKPT_DIR:-out/ckpt-$PRESET-seed$SEED-skew$SKEW}
if [ ! -f "$CKPT/config.json" ]; then
  if [ "$PRESET" = k3 ]; then
    echo "generating one K3 layer: about 15.8 GB on disk, a few minutes"
  fi
  rm -rf "$CKPT"
  mkdir -p "$(dirname "$CKPT")"
  "$BUILD/services/moe-tool" synth --config "$PRESET" --out "$CKPT.tmp" --seed "$SEED" --skew "$SKEW"
  mv "$CKPT.tmp" "$CKPT"
fi
for BACKEND in cpu ref; do
  if [ "$BACKEND" = ref ] && [ "$PRESET" = k3 ] && [ "$TOKENS" -gt 16 ]; then
    echo "(skipping the reference for k3 above 16 tokens: about 1 s per token)"
    continue
  fi
  "$BUILD/services/moe-tool" forward --checkpoint "$CKPT" --tokens "$TOKENS" --seed 7 \
    --backend "$BACKEND" --repeat 2 --output "$CKPT/forward-$TOKENS-$BACKEND.safetensors"
done
