#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a bounded time from a
# seed corpus: the safetensors parser, expert-svc's DispatchRequest validation, attention-svc's
# ForwardRequest input decoding, the QB and dynamic k histogram wire forms, the page's query
# parser, the data plane's UCX hello, lanes and batch-frame parsers and its replay window, and
# the shm lane's ring reader and writer against whatever a peer writes into the ring.
# Allocations past 512 MiB count as findings (a small input must not claim a large buffer).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 20: the test command; a campaign: 600)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-20}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ not found, skipping the fuzzers (the corpus tests still ran)"
  exit 0
fi
BUILD=${MOE_FUZZ_BUILD_DIR:-build-fuzz}
TARGETS=(safetensors_fuzz dispatch_fuzz forward_fuzz qb_histogram_fuzz budget_histogram_fuzz
  http_query_fuzz data_plane_fuzz shm_ring_fuzz)
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DMOE_BUILD_FUZZERS=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" --target "${TARGETS[@]}"
CORPUS="$BUILD/fuzz-corpus"
mkdir -p "$CORPUS"
/usr/bin/python3 tests/fuzz/make_seed_corpus.py "$CORPUS/safetensors"
/usr/bin/python3 tests/fuzz/make_proto_seeds.py "$CORPUS"
# The data plane's hello and lanes: a well-formed hello shape and a lanes report as seeds.
mkdir -p "$CORPUS/data_plane"
printf 'MOEH\001\001\000\000\000\000\000\000\000abcdefghijklmnop' >"$CORPUS/data_plane/hello"
printf '#  lane[0]:  2:posix/memory.0 md[1] -> md[1]/posix am\n#  lane[1]:  0:tcp/lo.0 md[0]\n' \
  >"$CORPUS/data_plane/lanes"
# A batch message's frame: token, MOEB, version 1, kind 1, client 1, sequence 1, header 2, MAC.
printf '\001\000\000\000\000\000\000\000MOEB\001\001\000\000\001\000\000\000\000\000\000\000\001\000\000\000\000\000\000\000\002\000\000\000\000\000\000\000abcdefghijklmnop' \
  >"$CORPUS/data_plane/frame"
# A ring holding one record of a 10-byte header and 100 bytes of payload, read from its start.
mkdir -p "$CORPUS/shm_ring"
printf '\000\001\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\001\000\000\000\000\000\000\001\000\000\000\012\000\000\000\144\000\000\000\000\000\000\000' \
  >"$CORPUS/shm_ring/record"
for t in "${TARGETS[@]}"; do
  name=${t%_fuzz}
  log="$BUILD/$t.log"
  "$BUILD/tests/$t" -max_total_time="$SECONDS_EACH" -max_len=65536 -malloc_limit_mb=512 \
    -rss_limit_mb=2048 -print_final_stats=1 "$CORPUS/$name" 2>"$log" ||
    { tail -60 "$log"; echo "fuzz: $t found a failure (log: $log)"; exit 1; }
  echo "fuzz: $t: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') inputs" \
    "in ${SECONDS_EACH} s, $(grep -E '^stat::peak_rss_mb' "$log" | awk '{print $2}') MB peak RSS"
done
