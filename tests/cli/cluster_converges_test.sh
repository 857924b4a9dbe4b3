#!/usr/bin/env bash
# The main job (moe-cli cluster, what scripts/run.sh runs) on a small skewed checkpoint: it
# rebalances after each window until MaxVio is within 1.5x of the window's noise floor, at most
# four times, prints every step and a verdict, and exits 0.
# Usage: tests/cli/cluster_converges_test.sh MOE_TOOL MOE_CLI WORK_DIR
set -euo pipefail
tool=$1 cli=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
"$tool" synth --config tiny --out "$work/ckpt" --seed 3 --skew 1.5 >/dev/null
out=$(timeout 240 "$cli" cluster --checkpoint "$work/ckpt" --shards 2 --duration 2 \
  --concurrency 2 --tokens 32 --work_dir "$work/logs" 2>"$work/stderr.log")
echo "$out"
fail() { echo "FAIL: $*" >&2; exit 1; }
echo "$out" | grep -q '^step 1: bias version' || fail "no first step"
echo "$out" | grep -q 'after Rebalance 1 ' || fail "no summary line per step"
echo "$out" | grep -Eq '^(converged: MaxVio within 1.5x of the noise floor after [1-4] Rebalances?|not converged: )' ||
  fail "no verdict"
steps=$(echo "$out" | grep -c '^step [0-9]*: bias version')
[ "$steps" -le 4 ] || fail "$steps steps (at most 4)"
# Each step's ratio is what the verdict says.
last=$(echo "$out" | grep '^step ' | tail -1 | sed -E 's/.*, ([0-9.]+)x the window.*/\1/')
if echo "$out" | grep -q '^converged'; then
  awk -v r="$last" 'BEGIN { exit !(r <= 1.5) }' || fail "converged at ${last}x"
else
  [ "$steps" -eq 4 ] || fail "gave up after $steps steps"
fi
echo "OK: $steps step(s), last at ${last}x the floor"
