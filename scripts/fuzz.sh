#!/usr/bin/env bash
# Builds the libFuzzer target for the safetensors parser with clang (ASan + UBSan) and runs it
# for a bounded number of inputs from a seed corpus of valid and malformed files.
# Usage: scripts/fuzz.sh [RUNS] (default 200000; bounded by 120 s as well)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-200000}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ not found, skipping the fuzzer (the corpus test still ran)"
  exit 0
fi
BUILD=${MOE_FUZZ_BUILD_DIR:-build-fuzz}
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DMOE_BUILD_FUZZERS=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" --target safetensors_fuzz
CORPUS="$BUILD/fuzz-corpus"
mkdir -p "$CORPUS"
/usr/bin/python3 tests/fuzz/make_seed_corpus.py "$CORPUS"
"$BUILD/tests/safetensors_fuzz" -runs="$RUNS" -max_total_time=120 -max_len=4096 \
  "$CORPUS" 2>"$BUILD/fuzz.log" || { tail -50 "$BUILD/fuzz.log"; exit 1; }
echo "fuzz: $(grep -E '^Done|^#[0-9]+.*DONE' "$BUILD/fuzz.log" | tail -1)"
