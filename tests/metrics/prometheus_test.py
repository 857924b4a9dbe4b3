#!/usr/bin/python3
"""A real Prometheus server scraping a real local cluster under load.

Starts `moe-cli up` (router-svc, two expert-svc shards, attention-svc on loopback, each with a
/metrics port), runs skewed traffic with `moe-cli loadgen`, starts Debian's `prometheus` on
loopback scraping every metrics port each second, and checks with PromQL:
  * per-expert routed-token totals equal the router's own cumulative loads (GetLoadStats);
  * the token total, the shards' computed rows and the per-shard counters agree with them;
  * the imbalance gauge equals the router's window MaxVio;
then checks that every metric name the Grafana dashboard uses appears on a live /metrics.
Every wait is bounded in time; every process is stopped at the end.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from cluster_helpers import synth_checkpoint, wait_for  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def promql(prom, query):
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    body = json.loads(http_get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-cli", required=True)
    ap.add_argument("--moe-tool", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dashboard", required=True)
    args = ap.parse_args()
    ckpt = synth_checkpoint(args.moe_tool, args.work, "mid", 3)
    cluster_dir = os.path.join(args.work, "cluster")
    # A fresh cluster: no cluster.json, no router state from an earlier run (moe-cli up keeps it).
    for stale in ("cluster.json", "router.db", "router.db-wal", "router.db-shm"):
        if os.path.exists(os.path.join(cluster_dir, stale)):
            os.remove(os.path.join(cluster_dir, stale))
    procs = []
    try:
        up = subprocess.Popen([args.moe_cli, "up", "--checkpoint", ckpt, "--work_dir", cluster_dir,
                               "--threads", "1", "--max_seconds", "600",
                               "--attention_args", "--report_interval_ms=100"],
                              stdout=subprocess.DEVNULL)
        procs.append(up)
        path = os.path.join(cluster_dir, "cluster.json")
        wait_for("cluster.json", lambda: os.path.exists(path), 120)
        cluster = json.load(open(path))
        targets = [cluster["router_metrics"], cluster["attention_metrics"]] + [
            s["metrics"] for s in cluster["shards"]]

        # Skewed traffic, bounded in count and time.
        load = subprocess.run([args.moe_cli, "loadgen", "--cluster", path,
                               "--checkpoint", ckpt, "--duration", "3", "--concurrency", "2",
                               "--tokens", "64"], capture_output=True, text=True, timeout=120)
        print(load.stdout.strip())
        assert load.returncode == 0, load.stderr

        # One bad request (wrong width): counted once under its code.
        bad = os.path.join(args.work, "bad.npy")
        numpy.save(bad, numpy.zeros((2, 100), dtype=numpy.float32))
        out = subprocess.run([args.moe_cli, "forward", "--cluster", path,
                              "--layer", "1", "--input", bad], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr, out.stderr

        def stats():
            out = subprocess.run([args.moe_cli, "stats", "--json", "--cluster", path,
                                  "--layer", "1"], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)
        # The last statistics report lands within the report interval.
        forwarded = int(re.search(r"requests \d+ \(ok (\d+)\)", load.stdout).group(1)) * 64
        s = wait_for("the final statistics report",
                     lambda: (lambda x: x if int(x["totalTokens"]) == forwarded else None)(stats()),
                     30)
        total_loads = [int(v) for v in s["totalLoads"]]
        window_vio = s["windowBalance"]["maxVio"]
        print(f"router: {forwarded} tokens, {sum(total_loads)} routed pairs, window MaxVio "
              f"{window_vio:.4f}")

        # A real Prometheus scraping every service each second.
        prom_dir = os.path.join(args.work, "prometheus")
        shutil.rmtree(prom_dir, ignore_errors=True)  # no series left from an earlier run
        os.makedirs(prom_dir)
        config = os.path.join(prom_dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: moe\n    static_configs:\n"
                    f"      - targets: {json.dumps(targets)}\n")
        prom = f"127.0.0.1:{free_port()}"
        p = subprocess.Popen(["prometheus", f"--config.file={config}",
                              f"--storage.tsdb.path={os.path.join(prom_dir, 'data')}",
                              f"--web.listen-address={prom}", "--log.level=warn"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        wait_for("every target up", lambda: len([r for r in promql(prom, "up == 1")]) ==
                 len(targets), 90)

        q_tokens = 'sum(moe_forward_tokens_total{layer="1"})'
        wait_for("a scrape after the traffic", lambda: promql(prom, q_tokens) and
                 float(promql(prom, q_tokens)[0]["value"][1]) == forwarded, 60)

        q_experts = 'sum by (expert) (moe_expert_tokens_total{layer="1"})'
        per_expert = {int(r["metric"]["expert"]): float(r["value"][1])
                      for r in promql(prom, q_experts)}
        assert len(per_expert) == len(total_loads), (len(per_expert), len(total_loads))
        for e, n in enumerate(total_loads):
            assert per_expert[e] == n, f"expert {e}: Prometheus {per_expert[e]}, router {n}"
        print(f"PromQL {q_experts}: {len(per_expert)} series equal to the router's loads "
              f"(hottest {max(per_expert.values()):.0f}, coldest {min(per_expert.values()):.0f})")

        q = 'sum(moe_shard_tokens_total{layer="1"})'
        v = float(promql(prom, q)[0]["value"][1])
        assert v == sum(total_loads), f"{q} = {v}, router {sum(total_loads)}"
        print(f"PromQL {q} = {v:.0f} (= routed pairs)")
        # The shards also computed the attention node's readiness canaries (4 tokens at the full
        # top-k each, not in the router's loads): what they counted beyond the routed pairs is a
        # whole number of canaries, at most one more than the node counted (scraped apart).
        q = 'sum(moe_expert_rows_total{layer="1"})'
        v = float(promql(prom, q)[0]["value"][1])
        answered = promql(prom, 'sum(moe_canary_checks_total{outcome=~"match|mismatch|skipped"})')
        canaries = float(answered[0]["value"][1]) if answered else 0.0
        per_canary = 4 * (sum(total_loads) // forwarded)  # every request at the full top-k
        extra = v - sum(total_loads)
        assert extra >= 0 and extra % per_canary == 0 and extra / per_canary <= canaries + 1, (
            f"{q} = {v}, router {sum(total_loads)}, {canaries:.0f} canaries of {per_canary} rows")
        print(f"PromQL {q} = {v:.0f} (= routed pairs + {extra / per_canary:.0f} readiness canaries)")

        q_err = 'moe_errors_total{service="attention-svc",method="Forward"}'
        errors = {r["metric"]["code"]: float(r["value"][1]) for r in promql(prom, q_err)}
        assert errors == {"INVALID_ARGUMENT": 1.0}, errors
        print(f"PromQL {q_err}: {errors}")

        # Successes: every OK request of the load generator (64 tokens each), nothing in flight
        # or queued now; expert-svc counted its batches.
        q_ok = 'moe_requests_succeeded_total{service="attention-svc",method="Forward"}'
        ok = float(promql(prom, q_ok)[0]["value"][1])
        assert ok * 64 == forwarded, (ok, forwarded)
        for q in ['sum(moe_requests_in_flight)', 'sum(moe_queue_depth)']:
            assert float(promql(prom, q)[0]["value"][1]) == 0, q
        q_batches = 'sum(moe_requests_succeeded_total{service="expert-svc",method="Dispatch"})'
        assert float(promql(prom, q_batches)[0]["value"][1]) >= ok, q_batches
        print(f"PromQL {q_ok} = {ok:.0f} (= OK requests); in flight and queued: 0")
        # Process metrics of every service: CPU used, RSS, open descriptors.
        for q, low, high in [('process_cpu_seconds_total', 0.01, 1e5),
                             ('process_resident_memory_bytes', 1 << 20, 16 << 30),
                             ('process_open_fds', 3, 1e5), ('process_threads', 1, 1e4)]:
            rows = promql(prom, q)
            assert len(rows) == len(targets), (q, len(rows))
            for r in rows:
                v = float(r["value"][1])
                assert low <= v <= high, (q, r["metric"].get("instance"), v)
        print(f"PromQL process_*: CPU, RSS, fds and threads of all {len(targets)} services")

        q_vio = 'moe_imbalance_max_vio{layer="1"}'
        vio = float(promql(prom, q_vio)[0]["value"][1])
        assert abs(vio - window_vio) <= 1e-9 * max(1.0, window_vio), (vio, window_vio)
        assert vio > 1.0, f"skewed traffic should be imbalanced, MaxVio {vio}"
        print(f"PromQL {q_vio} = {vio:.4f} (router window: {window_vio:.4f})")
        # Over all observations (the traffic ended before Prometheus started, so no rate()).
        q_p99 = 'histogram_quantile(0.99, sum by (le) (moe_forward_duration_seconds_bucket{layer="1"}))'
        p99 = float(promql(prom, q_p99)[0]["value"][1])
        assert 0 < p99 < 10, p99
        print(f"PromQL {q_p99} = {p99:.4f} s")

        # Every metric name of the Grafana dashboard is exported by a live service.
        dash = json.load(open(args.dashboard))
        exprs = []
        def collect(node):
            if isinstance(node, dict):
                for k, v in node.items():
                    if k in ("expr", "query") and isinstance(v, str):
                        exprs.append(v)
                    else:
                        collect(v)
            elif isinstance(node, list):
                for v in node:
                    collect(v)
        collect(dash)
        names = set()
        for e in exprs:
            names.update(re.findall(r"\bmoe_[a-z0-9_]+", e))
        exported = "\n".join(http_get(f"http://{t}/metrics") for t in targets)
        exported_names = set(re.findall(r"^(moe_[a-z0-9_]+)", exported, re.M))
        missing = sorted(n for n in names if n not in exported_names)
        assert not missing, f"dashboard uses metrics no service exports: {missing}"
        print(f"Grafana dashboard: {len(exprs)} queries, {len(names)} metric names, all exported")
        # The process panels show this release's services only, each named: the dashboard's
        # queries (variables at "All") joined on moe_build_info give one series per service.
        def panel(title):
            return next(p for p in dash["panels"] if p["title"] == title)
        for t in panel("Process memory and descriptors")["targets"]:
            q = t["expr"].replace("$job", ".*").replace("$namespace", ".*")
            rows = promql(prom, q)
            assert len(rows) == len(targets), (q, len(rows))
            services_seen = sorted(r["metric"].get("service", "") for r in rows)
            assert all(services_seen), (q, services_seen)
        print(f"Grafana process panels: one series per service ({', '.join(services_seen)})")

        # The metrics reference page (docs/metrics.md, generated from the metric table) lists
        # exactly the moe_ metrics the services export, with their types and label names.
        page_path = os.path.join(os.path.dirname(args.dashboard), "..", "..", "docs", "metrics.md")
        page = {m[0]: (m[1], {l.strip() for l in m[2].split(",") if l.strip()}) for m in
                re.findall(r"^\| `(moe_[a-z0-9_]+)` \| ([a-z]+) \| ([^|]*)\|", open(page_path).read(),
                           re.M)}
        # Histogram series carry _bucket/_sum/_count (no counter or gauge here ends so).
        exported_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported_names}
        assert set(page) == exported_families, (f"docs/metrics.md vs /metrics: missing from the page "
                                                f"{sorted(exported_families - set(page))}, not "
                                                f"exported {sorted(set(page) - exported_families)}")
        types = dict(re.findall(r"^# TYPE (moe_[a-z0-9_]+) ([a-z]+)$", exported, re.M))
        wrong_type = {n: (page[n][0], types.get(n)) for n in page if page[n][0] != types.get(n)}
        assert not wrong_type, f"docs/metrics.md types vs /metrics (page, exported): {wrong_type}"
        labels = {}
        for name, body in re.findall(r"^(moe_[a-z0-9_]+)\{([^\n]*)\} ", exported, re.M):
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in page else name
            keys = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"', body)) - {"le"}
            labels.setdefault(family, set()).update(keys)
        wrong_labels = {n: (sorted(page[n][1]), sorted(labels[n])) for n in labels
                        if labels[n] != page[n][1]}
        assert not wrong_labels, f"docs/metrics.md labels vs /metrics (page, exported): {wrong_labels}"
        print(f"docs/metrics.md: {len(page)} metrics, all exported with the page's types, none "
              f"unlisted; labels as written for the {len(labels)} with labelled series")
        print("PASS")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    sys.exit(main())
