#!/usr/bin/env bash
# Builds the GPU check standalone (CUDA only) and runs it: every CUDA op against the CPU
# reference, then decode bandwidth and prefill TFLOP/s at K3 shapes. Under 5 minutes on an
# H200. Exit 77 without a GPU (a skip), 1 on a failed check.
# Usage: tests/gpu/run.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
cmake -S tests/gpu -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j
exec "$BUILD/gpu_check"
