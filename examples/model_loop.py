#!/usr/bin/python3
"""A decode loop through every MoE layer of a checkpoint, with the routed experts served by one
cluster: what an attention engine does with the expert tier, at toy scale.

The model is a small decoder written here in PyTorch (Debian's python3-torch): a token
embedding with sinusoidal positions, then one block per MoE layer of the checkpoint (pre-norm
causal multi-head attention with a KV cache, then pre-norm MoE), a final norm and an LM head.
Everything but the MoE blocks is local, fp32 and seeded; each MoE block is a
`moe_client.torch_module.RemoteMoeBlock` for its layer (or any module with the same contract:
[T, H] float32 in, the layer's bf16 output as float32 out). Greedy decoding of B sequences.

    python3 examples/model_loop.py --attention 127.0.0.1:50051 --batch 4 --steps 16
    python3 examples/model_loop.py --attention ... --bench 1,4,16,64 --plot loop.png

The cluster must serve every MoE layer of its checkpoint (`moe-cli up --layers 1,2,3` on a
checkpoint made with `moe-tool synth --layers 1,2,3`). The per-step report splits each MoE call
from the response's stage timings: the attention node's own work (router, down-projection,
shared experts, combine and norm, up-projection), the wait for the expert tier beyond the
shared experts it overlaps, and the rest of the call's wall time (the client's gRPC hop and
queueing). docs/model-loop.md has the figures of this machine and how they were made.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

STAGES_NODE = ("router", "down_proj", "shared", "combine_norm", "up_proj")


def rms_norm(x, gamma, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


class Decoder(torch.nn.Module):
    """Embedding -> per MoE layer [x += attn(norm(x)); x += moe(norm(x))] -> norm -> LM head.

    moe_blocks: one module per MoE layer ([T, H] float32 -> [T, H] float32)."""

    def __init__(self, hidden, moe_blocks, vocab=256, head_dim=64, seed=0, max_len=4096):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        h = hidden
        self.hidden, self.vocab = h, vocab
        self.heads = max(1, h // head_dim)
        self.head_dim = h // self.heads
        self.moe_blocks = list(moe_blocks)
        rnd = lambda *shape, std: torch.randn(*shape, generator=g) * std  # noqa: E731
        self.embed = rnd(vocab, h, std=1.0)
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, h, 2, dtype=torch.float32) * (-math.log(10000.0) / h))
        self.positions = torch.zeros(max_len, h)
        self.positions[:, 0::2] = torch.sin(pos * freq)
        self.positions[:, 1::2] = torch.cos(pos * freq)
        self.layers = []
        for _ in self.moe_blocks:
            self.layers.append({
                "attn_norm": 1.0 + rnd(h, std=0.1), "moe_norm": 1.0 + rnd(h, std=0.1),
                # [in, out]: x @ w (contiguous) is 2.4x faster than x @ w.T on Debian's
                # PyTorch (generic BLAS) at one token.
                "wqkv": rnd(h, 3 * h, std=h ** -0.5), "wo": rnd(h, h, std=h ** -0.5),
            })
        self.final_norm = 1.0 + rnd(h, std=0.1)
        self.lm_head = rnd(h, vocab, std=h ** -0.5)

    def new_cache(self):
        return [{"k": None, "v": None} for _ in self.layers]

    def attention(self, x, layer, cache, start):
        """x [B, S, H] at positions [start, start + S); appends to the layer's KV cache."""
        b, s, h = x.shape
        qkv = (x @ layer["wqkv"]).view(b, s, 3, self.heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, heads, S, hd]
        cache["k"] = k if cache["k"] is None else torch.cat([cache["k"], k], dim=2)
        cache["v"] = v if cache["v"] is None else torch.cat([cache["v"], v], dim=2)
        scores = q @ cache["k"].transpose(-1, -2) / math.sqrt(self.head_dim)  # [B, hd, S, T]
        t = cache["k"].shape[2]
        causal = torch.arange(t)[None, :] > (start + torch.arange(s))[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ cache["v"]
        return out.transpose(1, 2).reshape(b, s, h) @ layer["wo"]

    def step(self, tokens, cache, start, timer=None):
        """tokens [B, S] at positions [start, start + S) -> logits [B, V] of the last position.
        timer(i, seconds, block): called after MoE block i with its wall time."""
        b, s = tokens.shape
        x = self.embed[tokens] + self.positions[start:start + s]
        for i, (layer, block) in enumerate(zip(self.layers, self.moe_blocks)):
            x = x + self.attention(rms_norm(x, layer["attn_norm"]), layer, cache[i], start)
            m = rms_norm(x, layer["moe_norm"]).reshape(b * s, self.hidden)
            t0 = time.perf_counter()
            y = block(m)
            if timer is not None:
                timer(i, time.perf_counter() - t0, block)
            x = x + y.reshape(b, s, self.hidden)
        return rms_norm(x[:, -1], self.final_norm) @ self.lm_head

    @torch.no_grad()
    def generate(self, prompts, steps, on_step=None):
        """Greedy decoding. prompts [B, P] int64 -> (tokens [B, steps], logits [steps, B, V]).
        on_step(step, seconds, calls): after each step (0: the prefill), its wall time and its
        MoE calls [(layer index, seconds, block.last_result or None)]."""
        cache = self.new_cache()
        tokens, logits = [], []
        cur, pos = prompts, 0
        for n in range(steps):
            calls = []
            timer = lambda i, sec, block: calls.append(  # noqa: E731
                (i, sec, getattr(block, "last_result", None)))
            t0 = time.perf_counter()
            out = self.step(cur, cache, pos, timer)
            wall = time.perf_counter() - t0
            if on_step is not None:
                on_step(n, wall, calls)
            pos += cur.shape[1]
            cur = out.argmax(dim=-1, keepdim=True)
            tokens.append(cur[:, 0])
            logits.append(out)
        return torch.stack(tokens, dim=1), torch.stack(logits)


def call_split(seconds, result):
    """One MoE call's wall time split by the response's stage timings (seconds): the node's
    own work, the wait for the expert tier beyond the shared experts it overlaps, the rest."""
    st = (result.seconds or {}) if result is not None else {}
    node = sum(st.get(k, 0.0) for k in STAGES_NODE)
    experts = max(0.0, st.get("dispatch", 0.0) - st.get("shared", 0.0))
    return {"wall": seconds, "node": node, "experts": experts,
            "hop": max(0.0, seconds - node - experts)}


class StepLog:
    """Collects generate()'s per-step figures: wall, local (everything but MoE calls), and per
    MoE call the split of call_split."""

    def __init__(self):
        self.steps = []

    def __call__(self, step, wall, calls):
        splits = [call_split(sec, res) for _, sec, res in calls]
        moe = sum(s["wall"] for s in splits)
        self.steps.append({"step": step, "wall": wall, "local": wall - moe, "calls": splits})

    def decode_means(self):
        """Means over the decode steps (the prefill, step 0, left out), per step."""
        dec = self.steps[1:]
        if not dec:
            return None
        n = len(dec)
        mean = lambda f: sum(f(s) for s in dec) / n  # noqa: E731
        out = {"wall": mean(lambda s: s["wall"]), "local": mean(lambda s: s["local"]),
               "moe_calls": len(dec[0]["calls"])}
        for k in ("wall", "node", "experts", "hop"):
            out["moe" if k == "wall" else k] = mean(lambda s, k=k: sum(c[k] for c in s["calls"]))
        return out


def remote_blocks(attention, layers, **client_options):
    from moe_client.torch_module import RemoteMoeBlock
    return [RemoteMoeBlock(attention, layer=l, **client_options) for l in layers]


def prompts_for(batch, length, vocab, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, length), generator=g)


def run(decoder, batch, prompt_len, steps, seed):
    log = StepLog()
    tokens, logits = decoder.generate(prompts_for(batch, prompt_len, decoder.vocab, seed), steps,
                                      log)
    return tokens, logits, log


def bench(decoder, batches, prompt_len, steps, seed, project_layers):
    """tokens/s per batch size B, measured and projected to project_layers MoE layers."""
    rows = []
    for b in batches:
        _, _, log = run(decoder, b, prompt_len, steps, seed)
        m = log.decode_means()
        layers = m["moe_calls"]
        per_layer = m["wall"] / layers
        rows.append({"batch": b, "layers": layers, "step_ms": m["wall"] * 1e3,
                     "local_ms": m["local"] * 1e3, "node_ms": m["node"] * 1e3,
                     "experts_ms": m["experts"] * 1e3, "hop_ms": m["hop"] * 1e3,
                     "tokens_per_s": b / m["wall"],
                     "projected_step_ms": per_layer * project_layers * 1e3,
                     "projected_tokens_per_s": b / (per_layer * project_layers)})
    return rows


def unary_floor(client, calls=200):
    """One empty unary gRPC call from this client (the median of health(), which makes two:
    KServe v2 ServerLive and ServerReady, halved): what any gRPC call from Python costs here,
    the floor of each MoE call's "rest"."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        client.health()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / 2


def table(rows, project_layers):
    head = ("| B | MoE layers | step ms | local ms | node ms | experts ms | hop ms | tokens/s | "
            f"step ms at {project_layers} layers | tokens/s at {project_layers} layers |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['layers']} | {r['step_ms']:.2f} | {r['local_ms']:.2f} "
                     f"| {r['node_ms']:.2f} | {r['experts_ms']:.2f} | {r['hop_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['projected_step_ms']:.1f} | "
                     f"{r['projected_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def plot(rows, path, title, project_layers=92):
    """Two panels with gnuplot (gnuplot-nox): where a decode step's time goes per B, and
    tokens/s per B."""
    dat = path + ".dat"
    with open(dat, "w") as f:
        for r in rows:
            f.write(f"{r['batch']} {r['local_ms']} {r['node_ms']} {r['experts_ms']} "
                    f"{r['hop_ms']} {r['tokens_per_s']} {r['projected_tokens_per_s']}\n")
    script = f"""set terminal pngcairo size 1100,800 font 'sans,11'
set output '{path}'
set multiplot layout 2,1 title '{title}'
set style data histograms
set style histogram rowstacked
set style fill solid 0.8 border -1
set boxwidth 0.6
set key outside right
set grid y
set ylabel 'ms per decode step'
set xlabel 'sequences in flight (B)'
plot '{dat}' using 2:xtic(1) title 'local (attention, norms, head)', \\
     '' using 3 title 'MoE: attention node', '' using 4 title 'MoE: expert tier', \\
     '' using 5 title 'MoE: gRPC hop'
set style data linespoints
set logscale x 2
set logscale y
set ylabel 'tokens/s'
plot '{dat}' using 1:6 pt 7 title 'measured', \\
     '' using 1:7 pt 7 title 'projected to {project_layers} MoE layers'
unset multiplot
"""
    r = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True, timeout=60)
    os.remove(dat)
    if r.returncode != 0:
        raise RuntimeError(f"gnuplot failed (is gnuplot-nox installed?): {r.stderr}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="a local cluster's cluster.json (moe-cli up): its "
                       "attention node and, with mutual TLS, its client certificate")
    where.add_argument("--attention", help="attention-svc host:port (plaintext)")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=16, help="decode steps (the first: prefill)")
    ap.add_argument("--seed", type=int, default=0, help="the local weights' and prompts' seed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the local work")
    ap.add_argument("--bench", default="", help="comma-separated B values: tokens/s table")
    ap.add_argument("--project_layers", type=int, default=92,
                    help="MoE layers of the projected model (Kimi K3: 92)")
    ap.add_argument("--plot", default="", help="with --bench: write this PNG (gnuplot)")
    ap.add_argument("--json", default="", help="with --bench: write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "clients", "python"))
    from moe_client import Client, cluster_args
    where = cluster_args(args.cluster) if args.cluster else {"attention": args.attention}
    where = {k: where[k] for k in ("attention", "credentials") if where.get(k) is not None}
    with Client(**where) as c:
        info = c.model_info()
    attention = where.pop("attention")
    decoder = Decoder(info.hidden, remote_blocks(attention, list(info.layers), **where),
                      seed=args.seed)
    if args.bench:
        batches = [int(b) for b in args.bench.split(",")]
        rows = bench(decoder, batches, args.prompt, args.steps, args.seed, args.project_layers)
        print(table(rows, args.project_layers))
        with Client(attention, **where) as c:
            floor = unary_floor(c)
        print(f"one empty unary gRPC call from this client (median of 200): {floor * 1e3:.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.plot:
            plot(rows, args.plot, f"decode loop, {info.model}, {len(info.layers)} MoE layers",
                 args.project_layers)
        return 0
    tokens, _, log = run(decoder, args.batch, args.prompt, args.steps, args.seed)
    print(f"{info.model}: {len(info.layers)} MoE layers {list(info.layers)}, B = {args.batch}")
    for s in log.steps:
        parts = ", ".join(f"L{i}: {c['wall'] * 1e3:.2f} (node {c['node'] * 1e3:.2f}, experts "
                          f"{c['experts'] * 1e3:.2f}, hop {c['hop'] * 1e3:.2f})"
                          for i, c in enumerate(s["calls"]))
        print(f"step {s['step']:3d}: {s['wall'] * 1e3:7.2f} ms, local {s['local'] * 1e3:.2f}; "
              f"{parts}")
    print("tokens:", tokens.tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
