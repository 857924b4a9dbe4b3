#!/usr/bin/env bash
# The CPU benchmark of the CPU-kernel issues: this machine's limits (read bandwidth, FMA peak per
# ISA), the K3 expert shape in decode and prefill and the dense projections for every ISA the
# CPU has with 1 and all threads, and a whole k3 layer per ISA (and the reference at T = 1),
# printed as one table with the targets. Writes a synthetic k3 checkpoint (one layer, 16.1 GB)
# first if it is missing; about 2.5 min to generate, 8-9 min to run on two cores.
# Usage: scripts/bench.sh [--reference_tokens 1,16]   (MOE_CKPT_DIR overrides the path)
#        scripts/bench.sh --cluster [cluster_bench flags]  (data plane issues: in one run, the
#        hop to 1, 2, 4 shards per lane at 1-256 tokens per peer with its p50, p99, bytes on the
#        wire and the 92-layer decode step it projects, goodput of 1-8 senders to one shard,
#        next to the raw UCX transport (ucx_perftest) and the worker alone (hop_bench); the
#        dispatch round trip per lane with an echo backend, at T = 1, 16, 64, 256 on mid and
#        T = 1, 16 at the k3 shape (dispatch_bench); then the disaggregated layer on loopback vs
#        in process (cluster_bench, mid preset); about 6 min)
#        scripts/bench.sh --w4a8 [w4a8_bench flags]  (W4A8 vs W4A16 on one cluster: quality,
#        tokens/s, dispatch bytes; mid preset by default, about 30 s)
#        scripts/bench.sh --budget [budget_bench flags]  (dynamic k: tokens/s, latency, dispatch
#        bytes and output difference per expert budget, then the automatic mode under an
#        overload; mid preset by default, about 1 min; --preset k3 --overload=false for the k3
#        shape)
#        scripts/bench.sh --kernels  (the routed experts' kernels alone, no checkpoint: the
#        kernel choice with each probe's spread; the 1-8 token decode per set from DRAM and
#        L3-resident, p10 / p50 of 10 calls, and its arithmetic alone (L2-resident rows), next
#        to the read bandwidth measured before each row; prefill GFLOP/s per set from 64 to 4,096 tokens per expert; about 7 min)
#        scripts/bench.sh --model_loop [examples/model_loop.py flags]  (a decode loop through
#        every MoE layer of a mid checkpoint on one cluster, B = 1, 4, 16, 64: where a decode
#        step's time goes, tokens/s, projected to 92 MoE layers; writes out/model-loop.png;
#        about 1 min)
set -euo pipefail
cd "$(dirname "$0")/.."
REF_TOKENS=1
scripts/setup.sh
BUILD=${MOE_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja >/dev/null
if [ "${1:-}" = "--cluster" ]; then
  shift
  cmake --build "$BUILD" --target cluster_bench dispatch_bench hop_bench router-svc expert-svc \
    attention-svc
  lscpu | grep -E "^Model name|^CPU\(s\)|^CPU family|^Model:"
  "$BUILD/tests/hop_bench" --preset mid
  "$BUILD/tests/dispatch_bench" --preset mid --tokens 1,16,64,256
  "$BUILD/tests/dispatch_bench" --preset k3 --tokens 1,16
  exec "$BUILD/tests/cluster_bench" "$@"
fi
if [ "${1:-}" = "--kernels" ]; then
  cmake --build "$BUILD" --target moe-tool decode_bench
  lscpu | grep -E "^Model name|^CPU\(s\)|^CPU family|^Model:|^Flags" | cut -c1-200
  "$BUILD/services/moe-tool" kernels --config k3 --measure
  "$BUILD/tests/decode_bench" --tokens 1,2,4,8
  exec "$BUILD/tests/decode_bench" --experts 4 --runs 3 --tokens 64,128,256,512,1024,2048,4096
fi
if [ "${1:-}" = "--w4a8" ]; then
  shift
  cmake --build "$BUILD" --target w4a8_bench router-svc expert-svc attention-svc
  exec "$BUILD/tests/w4a8_bench" "$@"
fi
if [ "${1:-}" = "--model_loop" ]; then
  shift
  cmake --build "$BUILD" --target moe-tool moe-cli router-svc expert-svc attention-svc
  exec tests/bench/model_loop_bench.sh "$BUILD" out "$@"
fi
if [ "${1:-}" = "--budget" ]; then
  shift
  cmake --build "$BUILD" --target budget_bench router-svc expert-svc attention-svc
  lscpu | grep -E "^Model name|^CPU\(s\)"
  exec "$BUILD/tests/budget_bench" "$@"
fi
if [ "${1:-}" = "--reference_tokens" ]; then REF_TOKENS=$2; fi
cmake --build "$BUILD" --target moe-tool cpu_layer_bench qb_bench
CKPT=${MOE_CKPT_DIR:-out/ckpt-k3-seed1-skew1.0}
if [ ! -f "$CKPT/config.json" ]; then
  rm -rf "$CKPT" "$CKPT.tmp"
  mkdir -p "$(dirname "$CKPT")"
  "$BUILD/services/moe-tool" synth --config k3 --out "$CKPT.tmp" --seed 1 --skew 1.0
  mv "$CKPT.tmp" "$CKPT"
fi
lscpu | grep -E "^Model name|^CPU\(s\)|^CPU family|^Model:"
"$BUILD/services/moe-tool" kernels --config k3
"$BUILD/tests/cpu_layer_bench" --checkpoint "$CKPT" --reference_tokens "$REF_TOKENS"
"$BUILD/tests/qb_bench" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
