// K3-shape routed experts with random MXFP4 bytes for the CPU benchmarks (cpu_layer_bench,
// decode_bench): speed does not depend on the values, but denormals or infinities would, so the
// block scales lie near 2^-5 as trained weights' do.
#ifndef MOE_TESTS_BENCH_RANDOM_EXPERTS_H_
#define MOE_TESTS_BENCH_RANDOM_EXPERTS_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "services/common/model_config.h"
#include "services/common/random.h"
#include "services/numerics/layer_weights.h"

namespace moe::bench {

// The bytes and the weights that point into them (experts [0, experts)).
struct ExpertSet {
  std::vector<std::vector<uint8_t>> bytes;
  numerics::MoeLayerWeights w;
};

inline ExpertSet RandomExperts(const ModelConfig& cfg, int64_t experts) {
  ExpertSet s;
  s.w.expert_lo = 0;
  s.w.expert_hi = experts;
  s.w.experts.resize(static_cast<size_t>(experts));
  s.bytes.reserve(static_cast<size_t>(experts * 6));  // keeps references to elements valid
  const int64_t d = cfg.latent, in = cfg.intermediate;
  for (int64_t e = 0; e < experts; ++e) {
    numerics::Mxfp4Matrix* mats[] = {&s.w.experts[e].w1, &s.w.experts[e].w3, &s.w.experts[e].w2};
    for (int m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? d : in, cols = m == 2 ? in : d;
      s.bytes.emplace_back(static_cast<size_t>(rows * cols / 2));
      std::vector<uint8_t>& packed = s.bytes.back();
      Rng rng(MixSeed(9, {static_cast<uint64_t>(e), static_cast<uint64_t>(m)}));
      for (size_t i = 0; i + 8 <= packed.size(); i += 8) {
        const uint64_t r = rng.Next();
        std::memcpy(packed.data() + i, &r, 8);
      }
      s.bytes.emplace_back(static_cast<size_t>(rows * cols / 32));
      std::vector<uint8_t>& scales = s.bytes.back();
      for (uint8_t& v : scales) v = static_cast<uint8_t>(120 + rng.Next() % 4);
      *mats[m] = {rows, cols, packed.data(), scales.data()};
    }
  }
  return s;
}

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_RANDOM_EXPERTS_H_
