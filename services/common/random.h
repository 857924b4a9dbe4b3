// Deterministic, fast pseudo-random numbers for synthetic weights and traffic: the same seed
// gives the same bytes on every machine (no std::*_distribution, whose output is
// implementation-defined).
//
//   Rng rng(MixSeed(seed, layer, 7));
//   float x = rng.Normal();  // approximately N(0, 1), bounded by +-3.47
#ifndef MOE_SERVICES_COMMON_RANDOM_H_
#define MOE_SERVICES_COMMON_RANDOM_H_

#include <cstdint>
#include <initializer_list>

namespace moe {

inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Combines a seed with indices (layer, tensor kind, expert, ...) into an independent stream seed.
inline uint64_t MixSeed(uint64_t seed, std::initializer_list<uint64_t> parts) {
  uint64_t state = seed;
  uint64_t out = SplitMix64(state);
  for (uint64_t p : parts) {
    state ^= p + 0x632be59bd9b4e019ull + (out << 6) + (out >> 2);
    out = SplitMix64(state);
  }
  return out;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64(state_); }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Sum of four 16-bit uniforms (Irwin-Hall, n = 4), scaled to mean 0 and variance 1: close to a
  // normal and cheap enough to fill 15.7 GB of K3 experts.
  float Normal() {
    const uint64_t r = Next();
    const uint32_t sum = static_cast<uint32_t>(r & 0xffff) +
                         static_cast<uint32_t>((r >> 16) & 0xffff) +
                         static_cast<uint32_t>((r >> 32) & 0xffff) + static_cast<uint32_t>(r >> 48);
    // sum / 65536 has mean 2 and variance 4/12; sqrt(3) restores variance 1.
    return (static_cast<float>(sum) * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
  }

 private:
  uint64_t state_;
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_RANDOM_H_
