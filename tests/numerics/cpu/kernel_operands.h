// Operands of the CPU kernel tests: every ISA the kernels have, random bf16 and MXFP4 operands
// with the fp32 summation bound a row of MXFP4 weights must meet.
#ifndef MOE_TESTS_NUMERICS_CPU_KERNEL_OPERANDS_H_
#define MOE_TESTS_NUMERICS_CPU_KERNEL_OPERANDS_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/mxfp4.h"
#include "services/numerics/tolerance.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cpu::testing {

using tensor::Bf16;

// Every ISA the kernels have; those this CPU lacks are instantiated too and skip by name.
inline std::vector<Isa> AllIsas() {
  return {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx};
}
inline bool CpuHas(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(DetectIsa()); }

inline std::vector<Bf16> RandomBf16(int64_t n, float scale, uint64_t seed) {
  Rng rng(seed);
  std::vector<Bf16> v(static_cast<size_t>(n));
  for (Bf16& b : v) b = Bf16::FromFloat(scale * rng.Normal());
  return v;
}

// A random MXFP4 matrix [rows, cols] (weights ~ N(0, 0.05^2)), quantized by the reference.
struct RandomMxfp4 {
  RandomMxfp4(int64_t rows, int64_t cols, Rng& rng)
      : cols(cols), packed(rows * cols / 2), scales(rows * cols / 32) {
    std::vector<float> wv(rows * cols);
    for (float& v : wv) v = rng.Normal() * 0.05f;
    for (int64_t r = 0; r < rows; ++r) {
      QuantizeMxfp4Row(wv.data() + r * cols, cols, packed.data() + r * cols / 2,
                       scales.data() + r * cols / 32);
    }
  }
  // Asserts out[t * ld_out + (r - r0)] equals row r . x[t] (x: [tokens, cols]) within the fp32
  // summation bound of any order, for rows [r0, r1).
  void ExpectRows(int64_t r0, int64_t r1, const std::vector<float>& x, int64_t tokens,
                  const std::vector<float>& out, int64_t ld_out) const {
    std::vector<float> row(cols);
    for (int64_t r = r0; r < r1; ++r) {
      DequantizeMxfp4Row(packed.data() + r * cols / 2, scales.data() + r * cols / 32, cols,
                         row.data());
      for (int64_t t = 0; t < tokens; ++t) {
        double exact = 0, abs_sum = 0;
        for (int64_t i = 0; i < cols; ++i) {
          exact += double(row[i]) * x[t * cols + i];
          abs_sum += std::fabs(double(row[i]) * x[t * cols + i]);
        }
        ASSERT_NEAR(out[t * ld_out + (r - r0)], exact, cols * kMxfp4SumRelBound * abs_sum)
            << "cols " << cols << " row " << r << " token " << t;
      }
    }
  }
  int64_t cols;
  std::vector<uint8_t> packed, scales;
};

inline std::vector<float> RandomBf16Values(int64_t n, Rng& rng) {
  std::vector<float> x(n);
  for (float& v : x) v = tensor::RoundBf16(rng.Normal());
  return x;
}

}  // namespace moe::numerics::cpu::testing

#endif  // MOE_TESTS_NUMERICS_CPU_KERNEL_OPERANDS_H_
