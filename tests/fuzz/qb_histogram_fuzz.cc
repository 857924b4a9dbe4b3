// libFuzzer target: the Quantile Balancing histogram's wire form (attention nodes -> router-svc,
// numerics/qb.h) on any bytes: Deserialize accepts only consistent histograms (sizes agree),
// whose serialized form reads back to the same histogram; PredictLoads on an accepted one
// returns finite loads, one per expert.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "services/numerics/qb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto h = moe::numerics::QbHistogram::Deserialize(bytes);
  if (!h.ok()) return 0;
  const std::string canonical = h->Serialize();
  auto again = moe::numerics::QbHistogram::Deserialize(canonical);
  if (!again.ok() || again->Serialize() != canonical) __builtin_trap();
  const int64_t n = h->num_experts();
  if (static_cast<int64_t>(h->loads().size()) != n) __builtin_trap();
  if (static_cast<int64_t>(h->counts().size()) != n * h->window().bins) __builtin_trap();
  if (n > 0 && n <= 4096) {
    const std::vector<float> bias(static_cast<size_t>(n), 0.0f);
    for (double load : h->PredictLoads(bias)) {
      if (!std::isfinite(load)) __builtin_trap();
    }
  }
  return 0;
}
