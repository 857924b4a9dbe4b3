#include "services/numerics/cpu/expert_ffn.h"

#include <algorithm>
#include <memory>

#include "services/numerics/precision_mode.h"

namespace moe::numerics::cpu {

using tensor::Bf16;

namespace {

// Tokens per block of an expert's token-major activations; a work item runs one block. At 4,096
// tokens the whole [slots, 4,096] activations (29 MB for K3's FC1) were walked by every work
// item, each slot's tokens 16 KB from the next: from 1,024 tokens up the pair panel fell 15%
// (services/numerics/cpu/README.md, "Token blocks"). A block of 512 is contiguous, its slots 2 KB
// apart, and the work items that share it run together while it is in L3.
constexpr int64_t kTokenBlock = 512;

// The routed experts' input: z [T, D] bf16, or its MXFP8 form (W4A8).
struct ExpertInput {
  const Bf16* bf16 = nullptr;
  const Mxfp8Rows* mxfp8 = nullptr;
  const int32_t* rows = nullptr;  // the z row of each routed token; null: its own
};

struct ActiveExpert {
  const ExpertWeights* w = nullptr;
  std::vector<int64_t> pairs;  // token * k + slot, ascending
  // Decode-sized batches: token rows in the table's layout, [n, ActivationSlots(.)].
  // Prefill (token_major): blocks of kTokenBlock tokens, each [TokenMajorSlots(.), ld_t] with
  // ld_t = the block's tokens rounded up to 16 (mxfp4_rows_tm), one after the other.
  bool token_major = false;
  int64_t ld_t = 0;
  int64_t blocks = 1;     // token blocks (1 unless token_major)
  std::vector<float> zp;  // z of the expert's tokens
  std::vector<float> hp;  // h, written by FC1
  // Tokens [First, End) of the expert's in token block b (all of them in rows form).
  int64_t First(int64_t b) const { return token_major ? b * kTokenBlock : 0; }
  int64_t End(int64_t b) const {
    const int64_t n = static_cast<int64_t>(pairs.size());
    return token_major ? std::min(n, (b + 1) * kTokenBlock) : n;
  }
};

// FC1 rows [r0, r1) of one expert for the tokens of block b, SiTU fused, written into hp.
void Fc1Block(const KernelTable& k, ActiveExpert& e, int64_t r0, int64_t r1, int64_t b, float beta,
              float linear_beta, Precision precision, W4A8H h_order) {
  const int64_t n = e.End(b) - e.First(b);
  const int64_t d = e.w->w1.cols, inter = e.w->w1.rows, rows = r1 - r0;
  const int64_t ld_z = ActivationSlots(k, d), ld_h = ActivationSlots(k, inter);
  // Scratch written in full by the kernels: no zero-fill (it cost about 5% at 256 tokens).
  const size_t count = static_cast<size_t>(n * rows);
  std::unique_ptr<float[]> g(new float[count]), u(new float[count]), h(new float[count]);
  // The block's activations (token-major: its own [slots, ld_t]; otherwise b = 0, all tokens).
  const float* zb = e.zp.data() + b * TokenMajorSlots(k, d) * e.ld_t;
  float* hb = e.hp.data() + b * TokenMajorSlots(k, inter) * e.ld_t;
  if (e.token_major) {
    k.mxfp4_rows_tm(e.w->w1.packed, e.w->w1.scales, d, r0, r1, zb, e.ld_t, n, g.get(), rows);
    k.mxfp4_rows_tm(e.w->w3.packed, e.w->w3.scales, d, r0, r1, zb, e.ld_t, n, u.get(), rows);
  } else {
    k.mxfp4_rows(e.w->w1.packed, e.w->w1.scales, d, r0, r1, e.zp.data(), ld_z, n, g.get(), rows);
    k.mxfp4_rows(e.w->w3.packed, e.w->w3.scales, d, r0, r1, e.zp.data(), ld_z, n, u.get(), rows);
  }
  // W4A8: h through MXFP8 before FC2 reads it, from the fp32 SiTU output unless asked via bf16.
  // A work item's rows start at a multiple of kExpertRowBlock (of 32), so its blocks of 32 are
  // the reference's blocks of each token's h.
  const bool fp32_h = precision == Precision::kW4A8 && h_order == W4A8H::kFromFp32;
  (fp32_h ? k.situ_f32 : k.situ)(g.get(), u.get(), n * rows, beta, linear_beta, h.get());
  if (precision == Precision::kW4A8) k.mxfp8_roundtrip(h.get(), n * rows);
  // h into the FC2 activations: the slot of each row once, not once per element; in tiles of
  // 16 tokens, so the lines of h a tile reads (16 rows each) stay in L1 across its rows
  // (walking all tokens per row missed once per (row, token) when h exceeds L2).
  for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {
    const int64_t t1 = std::min(n, t0 + kTokenTile);
    for (int64_t r = r0; r < r1; ++r) {
      const float* hr = h.get() + (r - r0);
      if (e.token_major && k.tm_layout == MxLayout::kBf16PairsTm) {
        // Rows in pairs (a work item starts at an even row): both halves of a slot at once.
        if ((r - r0) % 2 == 1) continue;
        const bool odd = r + 1 < r1;
        uint32_t* dst = reinterpret_cast<uint32_t*>(hb) + TokenMajorSlot(k, r) * e.ld_t;
        for (int64_t t = t0; t < t1; ++t) {
          dst[t] = Bf16PairBits(hr[t * rows], odd ? hr[t * rows + 1] : 0.0f);
        }
      } else if (e.token_major) {
        float* dst = hb + TokenMajorSlot(k, r) * e.ld_t;
        for (int64_t t = t0; t < t1; ++t) dst[t] = hr[t * rows];
      } else if (k.mx_layout != MxLayout::kBf16Pairs) {
        float* dst = e.hp.data() + ActivationSlot(k, r);
        for (int64_t t = t0; t < t1; ++t) dst[t * ld_h] = hr[t * rows];
      } else {
        for (int64_t t = t0; t < t1; ++t) {
          StoreActivation(k, e.hp.data() + t * ld_h, r, hr[t * rows]);
        }
      }
    }
  }
}

// FC2 rows [r0, r1) of the tokens of block b -> y at the expert's (token, slot) pairs.
void Fc2Block(const KernelTable& k, const ActiveExpert& e, int64_t r0, int64_t r1, int64_t b,
              Bf16* y) {
  const int64_t first = e.First(b), n = e.End(b) - first;
  const int64_t inter = e.w->w2.cols, d = e.w->w2.rows, rows = r1 - r0;
  const int64_t ld_h = ActivationSlots(k, inter);
  std::unique_ptr<float[]> out(new float[static_cast<size_t>(n * rows)]);
  if (e.token_major) {
    k.mxfp4_rows_tm(e.w->w2.packed, e.w->w2.scales, inter, r0, r1,
                    e.hp.data() + b * TokenMajorSlots(k, inter) * e.ld_t, e.ld_t, n, out.get(),
                    rows);
  } else {
    k.mxfp4_rows(e.w->w2.packed, e.w->w2.scales, inter, r0, r1, e.hp.data(), ld_h, n, out.get(),
                 rows);
  }
  for (int64_t t = 0; t < n; ++t) {
    Bf16* dst = y + e.pairs[first + t] * d;
    const float* src = out.get() + t * rows - r0;
    for (int64_t r = r0; r < r1; ++r) dst[r] = Bf16::FromFloat(src[r]);
  }
}

void RunPhases(const KernelTable& k, ThreadPool* pool, std::vector<ActiveExpert>& active,
               float beta, float linear_beta, Precision precision, W4A8H h_order, Bf16* y) {
  if (active.empty()) return;
  const int64_t inter = active[0].w->w1.rows, d = active[0].w->w1.cols;
  const int64_t fc1_blocks = (inter + kExpertRowBlock - 1) / kExpertRowBlock;
  const int64_t fc2_blocks = (d + kExpertRowBlock - 1) / kExpertRowBlock;
  // Work items: (expert, token block, row block), row blocks innermost, so the items handed out
  // together share a token block's activations. first[i]: the token blocks before expert i.
  std::vector<int64_t> first(active.size() + 1, 0);
  for (size_t i = 0; i < active.size(); ++i) first[i + 1] = first[i] + active[i].blocks;
  // Item -> (expert, token block, row block) for `row_blocks` per token block.
  auto locate = [&](int64_t item, int64_t row_blocks, int64_t* b, int64_t* rb) {
    const int64_t tb = item / row_blocks;
    *rb = item % row_blocks;
    const size_t e =
        static_cast<size_t>(std::upper_bound(first.begin(), first.end(), tb) - first.begin() - 1);
    *b = tb - first[e];
    return e;
  };
  pool->ParallelFor(first.back() * fc1_blocks, [&](int64_t item) {
    int64_t b = 0, rb = 0;
    const size_t e = locate(item, fc1_blocks, &b, &rb);
    Fc1Block(k, active[e], rb * kExpertRowBlock, std::min(inter, (rb + 1) * kExpertRowBlock), b,
             beta, linear_beta, precision, h_order);
  });
  pool->ParallelFor(first.back() * fc2_blocks, [&](int64_t item) {
    int64_t b = 0, rb = 0;
    const size_t e = locate(item, fc2_blocks, &b, &rb);
    Fc2Block(k, active[e], rb * kExpertRowBlock, std::min(d, (rb + 1) * kExpertRowBlock), b, y);
  });
}

// Token t's z row (of the expert's tokens) as fp32. MXFP8 rows are decoded here, once per
// (token, expert): every weight row of the expert then reads the same exact fp32 values from
// L1/L2 (decoding them again next to each weight chunk would cost more instructions per weight
// than the MXFP4 decode itself; docs/math.md section 6).
void ZRow(const ActiveExpert& e, const ExpertInput& z, int64_t k_slots, int64_t d, int64_t t,
          float* dst) {
  const int64_t token = e.pairs[t] / k_slots;
  const int64_t row = z.rows != nullptr ? z.rows[token] : token;
  if (z.mxfp8 != nullptr) {
    DequantizeMxfp8Row(*z.mxfp8, row, dst);
    return;
  }
  const Bf16* src = z.bf16 + row * d;
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i].ToFloat();
}

// The expert's z rows in the kernels' layout. Token-major (prefill) in tiles of 16 tokens: a
// tile's fp32 rows (16 x d) stay in L2 while they are written slot by slot, where the whole
// [n, d] fp32 copy (58 MB at 4,096 tokens of K3) was read a column at a time from DRAM.
void Prepare(const KernelTable& k, ActiveExpert& e, const ExpertInput& z, int64_t k_slots,
             int64_t d, int64_t inter) {
  const int64_t n = static_cast<int64_t>(e.pairs.size());
  e.token_major = k.mxfp4_rows_tm != nullptr && n >= k.panel_from;
  if (!e.token_major) {
    std::vector<float> zf(static_cast<size_t>(n * d));
    for (int64_t t = 0; t < n; ++t) ZRow(e, z, k_slots, d, t, zf.data() + t * d);
    e.zp.resize(static_cast<size_t>(n * ActivationSlots(k, d)));
    PrepareActivations(k, zf.data(), n, d, e.zp.data());
    e.hp.assign(static_cast<size_t>(n * ActivationSlots(k, inter)), 0.0f);
    return;
  }
  // Blocks of kTokenBlock tokens (the last one shorter), each with the same ld_t.
  e.blocks = (n + kTokenBlock - 1) / kTokenBlock;
  e.ld_t = (std::min(n, kTokenBlock) + 15) / 16 * 16;
  const int64_t z_block = TokenMajorSlots(k, d) * e.ld_t;
  e.zp.assign(static_cast<size_t>(e.blocks * z_block), 0.0f);
  std::vector<float> zf(static_cast<size_t>(kTokenTile * d));
  for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {  // kTokenTile divides kTokenBlock
    const int64_t t1 = std::min(n, t0 + kTokenTile);
    for (int64_t t = t0; t < t1; ++t) ZRow(e, z, k_slots, d, t, zf.data() + (t - t0) * d);
    // The tile's block, where token t is column t - base.
    float* zb = e.zp.data() + (t0 / kTokenBlock) * z_block;
    const int64_t base = t0 / kTokenBlock * kTokenBlock;
    for (int64_t i = 0; i < d; ++i) {
      if (k.tm_layout == MxLayout::kBf16PairsTm) {  // columns in pairs: whole slots
        if (i % 2 == 1) continue;
        uint32_t* dst = reinterpret_cast<uint32_t*>(zb) + TokenMajorSlot(k, i) * e.ld_t;
        for (int64_t t = t0; t < t1; ++t) {
          const float* zr = zf.data() + (t - t0) * d;
          dst[t - base] = Bf16PairBits(zr[i], i + 1 < d ? zr[i + 1] : 0.0f);
        }
        continue;
      }
      float* dst = zb + TokenMajorSlot(k, i) * e.ld_t;
      for (int64_t t = t0; t < t1; ++t) dst[t - base] = zf[(t - t0) * d + i];
    }
  }
  e.hp.assign(static_cast<size_t>(e.blocks * TokenMajorSlots(k, inter) * e.ld_t), 0.0f);
}

void Run(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
         const MoeLayerWeights& w, const Routing& routing, const ExpertInput& z,
         Precision precision, W4A8H h_order, Bf16* y) {
  const int64_t d = cfg.latent, k = routing.top_k;
  std::vector<std::vector<int64_t>> pairs = PairsByExpert(routing, cfg.num_experts);
  std::vector<ActiveExpert> active;
  for (int64_t e = 0; e < cfg.num_experts; ++e) {
    if (pairs[e].empty()) continue;
    ActiveExpert a;
    a.w = w.Expert(e);
    a.pairs = std::move(pairs[e]);
    active.push_back(std::move(a));
  }
  pool->ParallelFor(static_cast<int64_t>(active.size()),
                    [&](int64_t i) { Prepare(kernels, active[i], z, k, d, cfg.intermediate); });
  RunPhases(kernels, pool, active, cfg.situ_beta, cfg.situ_linear_beta, precision, h_order, y);
}

std::vector<Bf16> OutputFor(const ModelConfig& cfg, const Routing& routing) {
  return std::vector<Bf16>(static_cast<size_t>(routing.tokens * routing.top_k * cfg.latent));
}

}  // namespace

void RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                const MoeLayerWeights& w, const Routing& routing, const Bf16* z,
                absl::Span<const int32_t> z_rows, Bf16* y, Precision precision, W4A8H h_order) {
  if (precision == Precision::kW4A8) {
    int64_t n = routing.tokens;  // the rows of z read
    if (!z_rows.empty()) n = *std::max_element(z_rows.begin(), z_rows.end()) + 1;
    const Mxfp8Rows z8 = QuantizeMxfp8Rows(z, n, cfg.latent);
    RunExperts(kernels, pool, cfg, w, routing, z8, z_rows, y, h_order);
    return;
  }
  Run(kernels, pool, cfg, w, routing, {z, nullptr, z_rows.empty() ? nullptr : z_rows.data()},
      Precision::kW4A16, h_order, y);
}

void RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                const MoeLayerWeights& w, const Routing& routing, const Mxfp8Rows& z,
                absl::Span<const int32_t> z_rows, Bf16* y, W4A8H h_order) {
  Run(kernels, pool, cfg, w, routing, {nullptr, &z, z_rows.empty() ? nullptr : z_rows.data()},
      Precision::kW4A8, h_order, y);
}

std::vector<Bf16> RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                             const MoeLayerWeights& w, const Routing& routing, const Bf16* z,
                             Precision precision, W4A8H h_order) {
  std::vector<Bf16> y = OutputFor(cfg, routing);
  RunExperts(kernels, pool, cfg, w, routing, z, {}, y.data(), precision, h_order);
  return y;
}

std::vector<Bf16> RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                             const MoeLayerWeights& w, const Routing& routing, const Mxfp8Rows& z,
                             W4A8H h_order) {
  std::vector<Bf16> y = OutputFor(cfg, routing);
  RunExperts(kernels, pool, cfg, w, routing, z, {}, y.data(), h_order);
  return y;
}

void ExpertFfn(const KernelTable& kernels, const ExpertWeights& w, const Bf16* z, int64_t tokens,
               float beta, float linear_beta, Bf16* y, Precision precision, W4A8H h_order) {
  ThreadPool single(1);
  std::vector<ActiveExpert> active(1);
  active[0].w = &w;
  for (int64_t t = 0; t < tokens; ++t) active[0].pairs.push_back(t);
  Mxfp8Rows z8;
  if (precision == Precision::kW4A8) z8 = QuantizeMxfp8Rows(z, tokens, w.w1.cols);
  const ExpertInput in =
      precision == Precision::kW4A8 ? ExpertInput{nullptr, &z8} : ExpertInput{z, nullptr};
  Prepare(kernels, active[0], in, 1, w.w1.cols, w.w1.rows);
  RunPhases(kernels, &single, active, beta, linear_beta, precision, h_order, y);
}

}  // namespace moe::numerics::cpu
