// The prefill kernel's panel rows and kernel sets composed from two ISAs (a decode set of one,
// a prefill set of another, as the kernel choice composes them), against the reference. (Each
// ISA's own kernels: consistency_test.cc.)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/random.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/cpu/packed_linear.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/linear.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/numerics/shared_expert.h"
#include "services/numerics/situ.h"
#include "services/numerics/tolerance.h"
#include "tests/numerics/cpu/kernel_operands.h"
#include "tests/numerics/cpu/layer_check.h"

namespace moe::numerics::cpu {
namespace {

using tensor::Bf16;
using testing::AllIsas;
using testing::CheckLayerOn;
using testing::CpuHas;
using testing::RandomBf16;
using testing::RandomBf16Values;
using testing::RandomMxfp4;

// The prefill kernel (token-major activations: fp32 panels, bf16 pair panels on AVX512-BF16, or
// bf16 tiles on AMX) where the ISA has one, on row and column counts that are no multiple of a
// tile (29 rows from row 5; 37 tokens; 1216 columns: more than one block of each panel, the last
// one partial). A plain test over the ISAs that have one (no skipped instances in the ctest
// summary).
//
// 411 tokens (ld_t 432) run the kernels' token passes (192 at a time: two whole, one partial);
// the tokens past 411 rounded up to 16 hold NaN, which no kernel may read.
void CheckPanelRows(const KernelTable& k) {
  Rng rng(17);
  for (int64_t cols : {64, 448, 640, 1216, -448, 1088}) {
    // -448: 448 columns with block scales far from trained ones (2^-97): the pair panels' fp32
    // path.
    const bool tiny_scales = cols < 0;
    cols = tiny_scales ? -cols : cols;
    const bool many = cols == 1088;
    const int64_t rows = 29, tokens = many ? 411 : 37, ld_t = many ? 432 : 48,
                  slots = TokenMajorSlots(k, cols);
    RandomMxfp4 w(rows, cols, rng);
    if (tiny_scales) {
      for (uint8_t& s : w.scales) s = 30;
    }
    const std::vector<float> x = RandomBf16Values(tokens * cols, rng);
    std::vector<float> xt(slots * ld_t, 0.0f);  // token-major, in the table's slot order
    for (int64_t slot = 0; slot < slots; ++slot) {
      for (int64_t t = (tokens + 15) / 16 * 16; t < ld_t; ++t) xt[slot * ld_t + t] = std::nanf("");
    }
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < cols; ++i) StoreTokenMajor(k, xt.data(), ld_t, i, t, x[t * cols + i]);
    }
    const int64_t r0 = 5, r1 = rows;
    std::vector<float> out(tokens * (r1 - r0), -1.0f);
    k.mxfp4_rows_tm(w.packed.data(), w.scales.data(), cols, r0, r1, xt.data(), ld_t, tokens,
                    out.data(), r1 - r0);
    w.ExpectRows(r0, r1, x, tokens, out, r1 - r0);
  }
}

TEST(PrefillKernel, Mxfp4PanelRowsWithinTheSummationBound) {
  int tested = 0;
  for (Isa isa : AllIsas()) {
    if (!CpuHas(isa)) {
      std::printf("[ %s ] not on this CPU: its prefill kernel was not run\n", IsaName(isa));
      continue;
    }
    const KernelTable& k = KernelsFor(isa);
    if (k.mxfp4_rows_tm == nullptr) continue;
    SCOPED_TRACE(IsaName(isa));
    CheckPanelRows(k);
    ++tested;
  }
  if (tested == 0) GTEST_SKIP() << "no ISA with a prefill kernel on this CPU";
}

// What a measured choice runs (kernel_choice.h): one set's row kernels with another set's panel
// kernel, switching at any token count. Every pair of two sets this CPU has (one set's own
// pairing is the Consistency suite's), through the whole layer, within the layer tolerance, on
// both paths (the switch at 4 tokens puts the hot experts of 96 tokens on the panel kernel and
// the cold ones on the rows).
TEST(ComposedKernels, EveryPairOfSetsMatchesReference) {
  int tested = 0;
  // Distinct kernels only (AVX512-BF16 and AMX share their row kernels).
  std::set<std::pair<const void*, const void*>> seen;
  for (Isa isa : kSimdIsas) {  // each set's own table: the Consistency suite's
    seen.insert({reinterpret_cast<const void*>(KernelsFor(isa).mxfp4_rows),
                 reinterpret_cast<const void*>(KernelsFor(isa).mxfp4_rows_tm)});
  }
  for (Isa decode : kSimdIsas) {
    for (Isa prefill : kSimdIsas) {
      if (!CpuHas(decode) || !CpuHas(prefill)) continue;
      const auto rows = reinterpret_cast<const void*>(KernelsFor(decode).mxfp4_rows);
      const auto panel = reinterpret_cast<const void*>(KernelsFor(prefill).mxfp4_rows_tm);
      if (!seen.insert({rows, panel}).second) continue;  // these kernels already ran
      const KernelTable k = ComposeKernels(decode, prefill, 4);
      ASSERT_EQ(k.mxfp4_rows, KernelsFor(decode).mxfp4_rows);
      ASSERT_EQ(k.mxfp4_rows_tm, KernelsFor(prefill).mxfp4_rows_tm);
      ASSERT_EQ(k.panel_from, 4);
      const std::string label = KernelsName(k);
      CheckLayerOn(k, label, "mid", 96, 5);
      CheckLayerOn(k, label, "mid", 64, 6, Precision::kW4A8);
      ++tested;
    }
  }
  if (tested == 0) {
    GTEST_SKIP() << "fewer than two SIMD kernel sets on this CPU (" << IsaName(DetectIsa()) << ")";
  }
  std::printf("%d pairs of kernel sets run\n", tested);
}

// A table whose switch is never reached runs the rows at every size, and agrees too.
TEST(ComposedKernels, NoPanelRunsRowsEverywhere) {
  const Isa best = DetectIsa();
  if (best == Isa::kScalar) GTEST_SKIP() << "scalar only: no panel kernel to leave out";
  const KernelTable k = ComposeKernels(best, best, kNoPanel);
  EXPECT_EQ(KernelsName(k), IsaName(best));
  CheckLayerOn(k, std::string(IsaName(best)) + " rows only", "mid", 160, 7);
}

}  // namespace
}  // namespace moe::numerics::cpu
