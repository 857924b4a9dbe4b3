#!/usr/bin/python3
"""The hostile-client catalogue (docs/security.md): a real local cluster on loopback (`mid`,
two shards) attacked the way an outside client would, with Debian's python3-grpcio, raw
sockets and hand-made HTTP.

Every case asserts the status code and a piece of the message; after every case each of the
four processes must still be running and within its memory bound (its private RSS at start
plus MEMORY_SLACK, its shared memory at start plus SHARED_SLACK), and a canary thread that sends the same 4-token Forward the whole time must
have received only bit-exact answers (the oracle: `moe-tool forward`, the in-process C++
layer). The table printed at the end is the "hostile clients" figures of docs/security.md.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_TESTS, "common"))
sys.path.insert(0, os.path.join(_TESTS, "reference"))
sys.path.insert(0, os.path.join(_TESTS, "..", "clients", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_helpers import stop, synth_checkpoint, wait_for  # noqa: E402
from hostile_lib import (ADMIN, CANARY_TOKENS, CASES, MAX_WATCHERS, Canary, Ctx,  # noqa: E402
                         forward, forward_request, rss, stop_under_load)
from moe_reference import read_safetensors  # noqa: E402

# The catalogue, one module per surface; each case registers itself in CASES (in this order).
import hostile_cases_attention  # noqa: E402,F401
import hostile_cases_members  # noqa: E402,F401
import hostile_cases_http  # noqa: E402,F401

MEMORY_SLACK = 384 << 20  # what a process may grow by over the whole catalogue, privately
# Shared memory: the attention node's shm lane to the two shards, two rings of 64 MiB per
# shard (kShmClientRing), resident once batches that large used them (a shard maps its own
# pair only); UCX's FIFOs are a few MiB.
SHARED_SLACK = 2 * 2 * (64 << 20) + (16 << 20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-cli", required=True)
    ap.add_argument("--moe-tool", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", default="", help="run only the cases whose name has this text")
    args = ap.parse_args()
    from moe_client import load_protos
    import importlib
    pb = load_protos(out_dir=os.path.join(args.work, "protos"))
    pb.expert = importlib.import_module("moe.v1.expert_pb2")
    ckpt = synth_checkpoint(args.moe_tool, args.work, "mid", 4)
    ref_path = os.path.join(args.work, "canary.safetensors")
    subprocess.run([args.moe_tool, "forward", "--checkpoint", ckpt, "--tokens",
                    str(CANARY_TOKENS), "--seed", "9", "--output", ref_path], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    ref, _ = read_safetensors(ref_path)
    cluster_dir = os.path.join(args.work, "cluster")
    token_file = os.path.join(args.work, "admin_token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(ADMIN)
    cj = os.path.join(cluster_dir, "cluster.json")
    for stale in (cj, *glob.glob(os.path.join(cluster_dir, "router.db*"))):
        if os.path.exists(stale):
            os.remove(stale)
    up = subprocess.Popen(
        # Plaintext by name: the catalogue is what a stranger and a member's token can do
        # without certificates (and the REST front exists only there); the default mutual TLS is
        # tested in tls_test.cc and clients/python_client_test.py.
        [args.moe_cli, "up", "--insecure", "--checkpoint", ckpt, "--work_dir", cluster_dir,
         "--threads", "1",
         "--max_seconds", "900", "--admin_token_file", token_file,
         "--router_args", f"--max_watchers={MAX_WATCHERS}",
         "--attention_args", f"--max_message_bytes={64 << 20} --max_stream_in_flight=8 "
                             f"--max_stream_outbox_bytes={32 << 20}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failures = []
    try:
        wait_for("cluster.json", lambda: os.path.exists(cj), 180)
        cluster = json.load(open(cj))
        # Members' tokens: an attention node's and an expert's (the router holds the secret).
        token = open(os.path.join(cluster_dir, "attention_token")).read().strip()
        ctx = Ctx(cluster, pb, token, ref)
        # The secret, to derive any expert's token (the deployment gives each shard its own).
        ctx.cluster_secret = open(os.path.join(cluster_dir, "cluster_token")).read().strip()
        assert open(os.path.join(cluster_dir, "shard-0.token")).read().strip() == \
            ctx.expert_member("shard-0")[0][1], "shard-0.token is not the documented derivation"
        info = ctx.unary(ctx.shard0, "/moe.v1.ExpertService/GetInfo",
                         pb.expert.GetExpertInfoRequest(), pb.expert.ExpertServerInfo)
        ctx.latent = info.latent
        cluster["shard0_hi"] = info.expert_hi
        pids = {"router-svc": cluster["router_pid"], "attention-svc": cluster["attention_pid"]}
        for s in cluster["shards"]:
            pids[s["name"]] = s["pid"]
        wait_for("a first answer", lambda: forward(ctx, forward_request(ctx)), 60)
        base = {name: rss(pid) for name, pid in pids.items()}
        peak = dict(base)
        canary = Canary(ctx, seconds=600)
        canary.start()
        rows = []
        for name, fn in CASES:
            if args.only not in name:
                continue
            t = time.time()
            try:
                detail = fn(ctx)
                verdict = "ok"
            except Exception as e:  # a failed case is reported with the rest
                detail, verdict = f"{type(e).__name__}: {e}", "FAILED"
                failures.append(name)
            ms = 1000 * (time.time() - t)
            for pname, pid in pids.items():
                if not os.path.exists(f"/proc/{pid}"):
                    failures.append(f"{name}: {pname} died")
                    continue
                peak[pname] = tuple(map(max, peak[pname], rss(pid)))
                if peak[pname][0] > base[pname][0] + MEMORY_SLACK:
                    failures.append(f"{name}: {pname} RSS {peak[pname][0] >> 20} MiB")
                if peak[pname][1] > base[pname][1] + SHARED_SLACK:
                    failures.append(f"{name}: {pname} shared memory {peak[pname][1] >> 20} MiB")
            if canary.wrong:
                failures.append(f"{name}: the canary got a wrong answer")
            rows.append((name, verdict, ms, str(detail)[:110]))
        canary.stop.set()
        canary.join(timeout=20)
        t = time.time()
        try:
            detail = stop_under_load(ctx, pids)
            rows.append(("SIGTERM under load: every server stops", "ok",
                         1000 * (time.time() - t), detail))
        except AssertionError as e:
            rows.append(("SIGTERM under load: every server stops", "FAILED", 0, str(e)))
            failures.append("SIGTERM under load")
        width = max(len(r[0]) for r in rows)
        for i, (name, verdict, ms, detail) in enumerate(rows, 1):
            print(f"{i:2d}. {name:<{width}}  {verdict:6s} {ms:8.0f} ms  {detail}")
        print(f"\n{len(rows)} cases, {len(rows) - len(set(f.split(':')[0] for f in failures))} "
              f"passed; canary: {canary.ok} bit-exact, {canary.wrong} wrong, {canary.failed} "
              f"failed answers")
        for pname in pids:
            print(f"  {pname}: RSS {base[pname][0] >> 20} MiB at start, peak "
                  f"{peak[pname][0] >> 20} MiB (bound +{MEMORY_SLACK >> 20} MiB); shared memory "
                  f"{base[pname][1] >> 20} -> {peak[pname][1] >> 20} MiB (bound "
                  f"+{SHARED_SLACK >> 20} MiB)")
        if canary.errors:
            print("  canary errors:", canary.errors[:5])
        if canary.failed:
            failures.append(f"the canary had {canary.failed} failed answers")
    finally:
        stop(up)
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

