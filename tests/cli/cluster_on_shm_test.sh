#!/usr/bin/env bash
# The main job as users run it, with no --data_plane (auto, the default: docs/data-plane.md,
# "Choosing it"): on one host every shard offers UCX and shm, the node says hello to each shard
# over the memfd rings, traffic is answered, and nothing goes in band or over UCX.
# Usage: tests/cli/cluster_on_shm_test.sh MOE_TOOL MOE_CLI WORK_DIR
set -euo pipefail
tool=$1 cli=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
"$tool" synth --config tiny --out "$work/ckpt" --seed 3 >/dev/null
fail() { echo "FAIL: $*" >&2; exit 1; }
out=$(timeout 240 "$cli" cluster --checkpoint "$work/ckpt" --shards 2 --duration 2 \
  --concurrency 2 --tokens 32 --max_rebalances 0 --work_dir "$work/logs" \
  2>"$work/stderr.log") || { cat "$work/stderr.log" >&2; fail "moe-cli cluster failed"; }
for shard in shard-0 shard-1; do
  grep -q "shm data plane up" "$work/logs/$shard.log" || fail "$shard has no shm data plane"
  grep -q "ucx data plane up" "$work/logs/$shard.log" || fail "$shard offers no UCX beside it"
  grep -q "said hello over shm" "$work/logs/$shard.log" || fail "no hello to $shard over shm"
  grep -q "data plane to $shard: lanes shm" "$work/logs/attention-svc.log" ||
    fail "the node's lanes to $shard are not shm"
done
grep -q "fallback" "$work/logs/attention-svc.log" && fail "a batch went in band"
grep "data plane to shard-" "$work/logs/attention-svc.log" | grep -v ": lanes shm (shm) (the shard's side: shm)" &&
  fail "a shard's data plane opened on another lane (UCX)"
# The report says so too (the lanes the shards heartbeat to router-svc).
for shard in shard-0 shard-1; do
  echo "$out" | grep -Eq "^  $shard +data plane lanes: shm$" ||
    fail "the report does not say $shard is on shm: $(echo "$out" | grep 'data plane lanes')"
done
echo "$out" | grep -Eq '(converged|not converged)' || echo "$out" | grep -q 'requests' ||
  fail "no traffic report"
echo "OK: by default both shards on shm"
