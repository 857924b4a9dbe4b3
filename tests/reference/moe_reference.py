#!/usr/bin/python3
"""Independent NumPy reference of one Stable LatentMoE layer (docs/math.md section 4).

Reads a K3-format safetensors checkpoint itself (no C++ involved) and computes the layer with
the rounding points of docs/math.md and the summation orders docs/math.md section 8 asks an oracle to fix:
  * every matrix product: bf16 x bf16 products (exact in fp32) summed in fp32 over the
    reduction index in ascending order, starting from 0;
  * router weights: the selected scores summed in rank order;
  * combine: fp32 sum over a token's experts in ascending expert id;
  * RMSNorm: squares summed in ascending order.
Transcendental functions (exp, tanh) are evaluated in float64 and rounded once to float32, so
they can differ from a C library's float versions by about one float32 ulp; that is the only
expected source of disagreement with the C++ reference.

Debian's NumPy has no bfloat16: bf16 values are kept as uint16 bit patterns and converted by
hand (round to nearest even on the low 16 bits of the float32 pattern).

Run standalone:
  /usr/bin/python3 moe_reference.py --checkpoint DIR --input out.safetensors [--layer L]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

F32 = np.float32

# ---------------------------------------------------------------- safetensors and checkpoints

_DTYPES = {"BF16": np.uint16, "F32": np.float32, "U8": np.uint8, "I32": np.int32,
           "F16": np.float16, "I64": np.int64, "F64": np.float64}


def read_safetensors(path):
    """Returns {name: numpy array} (BF16 as uint16 bit patterns) and the metadata."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=_DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out, header.get("__metadata__", {})


class Checkpoint:
    def __init__(self, path):
        self.dir = path
        index = os.path.join(path, "model.safetensors.index.json")
        self.weight_map = None
        self.cache = {}
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        self.cfg = cfg.get("text_config", cfg)

    def get(self, name):
        fname = self.weight_map[name] if self.weight_map else "model.safetensors"
        if fname not in self.cache:
            self.cache[fname], _ = read_safetensors(os.path.join(self.dir, fname))
        return self.cache[fname][name]


# ---------------------------------------------------------------- number formats

def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """Round float32 to bf16 bit patterns, nearest even; NaN stays NaN."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def round_bf16(x):
    return bf16_to_f32(f32_to_bf16_bits(x))


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=F32)


def dequant_mxfp4(packed, scales):
    """packed [rows, cols/2] u8 (low nibble = even column), scales [rows, cols/32] E8M0."""
    rows = packed.shape[0]
    codes = np.empty((rows, packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    if np.any(scales == 0xFF):
        raise ValueError("E8M0 scale 0xFF (NaN)")
    scale = np.ldexp(F32(1.0), scales.astype(np.int32) - 127).astype(F32)
    return E2M1[codes] * np.repeat(scale, 32, axis=1)


# E4M3 magnitudes of the codes 0..0x7E, ascending (0x7F is NaN): exponent 0 subnormal.
E4M3 = np.array([(c & 7) / 8 * 2.0 ** -6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
                 for c in range(0x7F)], dtype=np.float64)


def mxfp8_roundtrip(x):
    """x [rows, cols] f32, through MXFP8 and back: per block of 32 along a row, the scale 2^e
    with e the smallest integer for which amax <= 448 * 2^e (clamped to [-127, 127]; an
    all-zero block 2^-127), each element the nearest E4M3 value of x / 2^e (a table search; ties
    to the even code), saturated at 448."""
    rows, cols = x.shape
    b = x.astype(np.float64).reshape(rows, cols // 32, 32)
    amax = np.max(np.abs(b), axis=2)
    _, p = np.frexp(np.where(amax > 0, amax, 1.0))  # amax = f 2^p, f in [0.5, 1)
    e = p - 1 - 8
    for _ in range(3):  # at most a step each way from floor(log2 amax) - 8
        e = np.where(amax > 448.0 * np.exp2(e), e + 1, e)
        e = np.where(amax <= 448.0 * np.exp2(e - 1), e - 1, e)
    e = np.clip(np.where(amax > 0, e, -127), -127, 127)
    scale = np.exp2(e)[:, :, None]
    a = np.minimum(np.abs(b) / scale, 448.0)
    hi = np.clip(np.searchsorted(E4M3, a), 0, len(E4M3) - 1)
    lo = np.clip(hi - 1, 0, len(E4M3) - 1)
    d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
    pick = np.where(d_hi < d_lo, hi, np.where(d_lo < d_hi, lo, np.where(hi % 2 == 0, hi, lo)))
    pick = np.where(a == E4M3[hi], hi, pick)
    out = np.copysign(E4M3[pick], b) * scale
    return out.reshape(rows, cols).astype(F32)


# ---------------------------------------------------------------- ops

def matmul_seq(x, w):
    """x [T, in] f32, w [out, in] f32 -> [T, out] f32, summed over `in` in ascending order."""
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=F32)
    wt = np.ascontiguousarray(w.T)
    for i in range(x.shape[1]):
        acc += np.outer(x[:, i], wt[i])  # the product is exact; only the add rounds
    return acc


def sigmoid(x):
    e = np.exp(-x.astype(np.float64)).astype(F32)
    return (F32(1.0) / (F32(1.0) + e)).astype(F32)


def tanh32(x):
    return np.tanh(x.astype(np.float64)).astype(F32)


def situ(g, u, b1, b2):
    b1, b2 = F32(b1), F32(b2)
    gate = (b1 * tanh32(g / b1)) * sigmoid(g)
    up = b2 * tanh32(u / b2)
    return (gate * up).astype(F32)


def budget_needs(b, k, tokens, selections, forced):
    """Dynamic k (docs/math.md 4.1): free selections each expert keeps for budget b. Every expert
    keeps max(f_j, lam * n_j); lam = b / k unless the forced selections alone pass that share,
    then the bisection value that makes the kept total b * tokens."""
    def kept(lam):
        total = 0.0
        for n, f in zip(selections.tolist(), forced.tolist()):
            total += min(max(lam * n, f), max(f, n))
        return total
    target = float(b) * float(tokens)
    lo, hi = 0.0, float(b) / float(k)
    if kept(hi) > target:
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if kept(mid) > target:
                hi = mid
            else:
                lo = mid
    return hi * selections.astype(np.float64) - forced.astype(np.float64)


def apportion_kept(need, free_counts, total):
    """Largest remainder: integer counts c_j within 1 of x_j = clip(need_j, 0, free_j) that sum
    to total (clipped to [0, sum free]): floor(x_j), then one more for the largest fractional
    parts (ties: lower j first), or one less for the smallest should the floors pass total."""
    x = np.clip(np.asarray(need, dtype=np.float64), 0.0, np.asarray(free_counts, dtype=np.float64))
    c = np.floor(x).astype(np.int64)
    frac = x - c
    total = int(min(max(total, 0), int(np.sum(free_counts))))
    order = sorted(range(len(x)), key=lambda j: (-frac[j], j))
    have = int(c.sum())
    for j in order:
        if have >= total:
            break
        if c[j] < free_counts[j]:
            c[j] += 1
            have += 1
    for j in reversed(order):
        if have <= total:
            break
        if c[j] > 0:
            c[j] -= 1
            have -= 1
    return c


def exact_budget_thresholds(s, bias, k, k_min):
    """The thresholds [k - 1, E] of one window of sigmoid scores s [m, E] routed with bias:
    for budget b, expert j's theta is the c_j-th largest score of its selections at ranks >=
    k_min, c_j apportioned by largest remainder to b * m minus the forced selections in all;
    +inf for c_j <= 0, 0 for c_j >= their count."""
    m, E = s.shape
    ids = np.argsort(-(s + bias.astype(F32)), axis=1, kind="stable")[:, :k]
    rank = np.broadcast_to(np.arange(k), ids.shape)
    forced = np.bincount(ids[rank < k_min], minlength=E)
    free = [np.sort(s[np.nonzero((ids == j) & (rank >= k_min))[0], j])[::-1] for j in range(E)]
    selections = forced + np.array([len(f) for f in free])
    table = np.zeros((k - 1, E), dtype=F32)
    free_counts = np.array([len(f) for f in free])
    for b in range(1, k):
        need = budget_needs(b, k, m, selections, forced)
        kept = apportion_kept(need, free_counts, b * m - int(forced.sum()))
        for j in range(E):
            c = int(kept[j])
            if c <= 0:
                table[b - 1, j] = np.inf
            elif c >= len(free[j]):
                table[b - 1, j] = 0.0
            else:
                table[b - 1, j] = free[j][c - 1]
    return table


def router_scores(ck, layer, x_bits):
    p = f"language_model.model.layers.{layer}.block_sparse_moe."
    x = bf16_to_f32(x_bits)
    return sigmoid(matmul_seq(x, bf16_to_f32(ck.get(p + "gate.weight")))), \
        ck.get(p + "gate.e_score_correction_bias").astype(F32)


def layer_forward(ck, layer, x_bits, precision="w4a16", budget=None, h_via_bf16=False):
    """precision: w4a16, or w4a8 (z and h through MXFP8 before the expert FCs that read them; h
    from the fp32 SiTU output as deployed stacks quantize it, or rounded to bf16 first when
    h_via_bf16: the project's order before, expert-svc --w4a8_h_via_bf16).
    budget: None, or (k_min, theta [E]) for dynamic k: a token keeps its first k_min selections
    and those with s >= theta of their expert, in rank order; the rest are id -1, weight 0.
    Or ("top_p", k_min, p): a token keeps the fewest of its top k, largest score first (ties:
    rank order), whose share of its top-k scores reaches p, and at least k_min."""
    a8 = mxfp8_roundtrip if precision == "w4a8" else (lambda v: v)
    c = ck.cfg
    H, D, I = c["hidden_size"], c["routed_expert_hidden_size"], c["moe_intermediate_size"]
    E, k = c["num_experts"], c["num_experts_per_token"]
    b1, b2 = c.get("activation_situ_beta", 4.0), c.get("activation_situ_linear_beta", 25.0)
    eps = F32(c.get("rms_norm_eps", 1e-5))
    scale = F32(c.get("routed_scaling_factor", 1.0))
    p = f"language_model.model.layers.{layer}.block_sparse_moe."
    W = lambda n: bf16_to_f32(ck.get(p + n))
    x = bf16_to_f32(x_bits)
    T = x.shape[0]
    assert x.shape[1] == H

    # 1. router, all fp32
    s = sigmoid(matmul_seq(x, W("gate.weight")))
    cbias = s + ck.get(p + "gate.e_score_correction_bias").astype(F32)
    ids = np.argsort(-cbias, axis=1, kind="stable")[:, :k]  # ties: lower id first
    sel = np.take_along_axis(s, ids, axis=1)
    keep = np.ones_like(ids, dtype=bool)
    if budget is not None and budget[0] == "top_p":
        _, k_min, top_p = budget
        keep = np.zeros_like(ids, dtype=bool)
        for t in range(T):
            total = 0.0
            for j in range(k):  # in rank order, in double
                total += float(sel[t, j])
            cum, taken = 0.0, 0
            for j in np.argsort(-sel[t], kind="stable"):  # largest first, ties by rank
                if taken >= k_min and cum >= top_p * total:
                    break
                keep[t, j] = True
                cum += float(sel[t, j])
                taken += 1
        budget = (k_min, None)
    elif budget is not None:
        k_min, theta = budget
        keep = (np.arange(k)[None, :] < k_min) | (sel >= theta[ids])
    if budget is not None:
        # kept slots first, in rank order (a stable sort of "not kept")
        order = np.argsort(~keep, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, axis=1)
        sel = np.take_along_axis(sel, order, axis=1)
        keep = np.take_along_axis(keep, order, axis=1)
        ids = np.where(keep, ids, -1)
        sel = np.where(keep, sel, F32(0))
    total = np.zeros(T, dtype=F32)
    for j in range(k):
        total = np.where(keep[:, j], (total + sel[:, j]).astype(F32), total)
    if c.get("moe_renormalize", True):
        weights = (sel / (total + F32(1e-20))[:, None]).astype(F32) * scale
    else:
        weights = sel * scale
    weights = np.where(keep, weights, F32(0)).astype(F32)

    # 2. latent down-projection
    z = round_bf16(matmul_seq(x, W("routed_expert_down_proj.weight")))

    # 3. experts, tokens grouped by expert
    y = np.zeros((T, k, D), dtype=F32)
    for e in np.unique(ids[ids >= 0]):
        rows, slots = np.nonzero(ids == e)
        pe = p + f"experts.{e}."
        w1 = dequant_mxfp4(ck.get(pe + "w1.weight_packed"), ck.get(pe + "w1.weight_scale"))
        w3 = dequant_mxfp4(ck.get(pe + "w3.weight_packed"), ck.get(pe + "w3.weight_scale"))
        w2 = dequant_mxfp4(ck.get(pe + "w2.weight_packed"), ck.get(pe + "w2.weight_scale"))
        ze = a8(z[rows])
        g = round_bf16(matmul_seq(ze, w1))
        u = round_bf16(matmul_seq(ze, w3))
        s_h = situ(g, u, b1, b2)
        h = a8(s_h) if precision == "w4a8" and not h_via_bf16 else a8(round_bf16(s_h))
        y[rows, slots] = round_bf16(matmul_seq(h, w2))

    # 4. combine in ascending expert id (dropped slots add nothing)
    order = np.argsort(np.where(ids >= 0, ids, E), axis=1, kind="stable")
    acc = np.zeros((T, D), dtype=F32)
    for j in range(k):
        slot = order[:, j]
        ys = y[np.arange(T), slot]
        ws = weights[np.arange(T), slot][:, None]
        live = (ids[np.arange(T), slot] >= 0)[:, None]
        acc = np.where(live, (acc + (ys * ws).astype(F32)).astype(F32), acc)
    r = round_bf16(acc)

    # 5. latent RMSNorm
    ss = np.zeros(T, dtype=F32)
    for d in range(D):
        ss = (ss + r[:, d] * r[:, d]).astype(F32)
    mean = (ss / F32(D)).astype(F32)
    inv = (F32(1.0) / np.sqrt(mean + eps)).astype(F32)
    n = round_bf16(r * inv[:, None])
    rn = round_bf16(W("routed_expert_norm.weight")[None, :] * n)

    # 6. up-projection; 7. shared experts; 8. sum
    o = round_bf16(matmul_seq(rn, W("routed_expert_up_proj.weight")))
    gs = round_bf16(matmul_seq(x, W("shared_experts.gate_proj.weight")))
    us = round_bf16(matmul_seq(x, W("shared_experts.up_proj.weight")))
    hs = round_bf16(situ(gs, us, b1, b2))
    sh = round_bf16(matmul_seq(hs, W("shared_experts.down_proj.weight")))
    out = f32_to_bf16_bits(o + sh)
    return out, ids.astype(np.int32), weights


def bf16_ulp_distance(a_bits, b_bits):
    """Distance in bf16 ulps between two arrays of bf16 bit patterns (+0 and -0 are equal)."""
    def ordered(b):
        b = b.astype(np.int64)
        return np.where(b & 0x8000, -(b & 0x7FFF), b & 0x7FFF)
    return np.abs(ordered(a_bits) - ordered(b_bits))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--input", required=True, help="safetensors with x (and the C++ out)")
    ap.add_argument("--layer", type=int, default=None)
    args = ap.parse_args()
    ck = Checkpoint(args.checkpoint)
    tensors, meta = read_safetensors(args.input)
    layer = args.layer if args.layer is not None else int(meta.get("layer", 1))
    out, ids, weights = layer_forward(ck, layer, tensors["x"])
    if "out" in tensors:
        dist = bf16_ulp_distance(out, tensors["out"])
        print(f"differing outputs: {np.count_nonzero(dist)} of {dist.size}, max ulp {dist.max()}")
        print(f"same expert ids: {np.array_equal(ids, tensors['expert_ids'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
