// libFuzzer target: dynamic k's budget histogram wire form (attention nodes -> router-svc,
// numerics/dynamic_k.h) on any bytes: Deserialize accepts only consistent histograms (counts
// and forced selections summing to tokens * k, runs of zeros inside the shape), whose
// serialized form reads back to the same histogram; SolveTable on an accepted one returns a
// [k - 1, E] table of thresholds in [0, 1] or +inf, never NaN.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "services/numerics/dynamic_k.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto h = moe::numerics::BudgetHistogram::Deserialize(bytes);
  if (!h.ok()) return 0;
  const std::string canonical = h->Serialize();
  auto again = moe::numerics::BudgetHistogram::Deserialize(canonical);
  if (!again.ok() || again->Serialize() != canonical) __builtin_trap();
  const int64_t n = h->num_experts(), k = h->window().top_k;
  if (static_cast<int64_t>(h->forced().size()) != n) __builtin_trap();
  if (static_cast<int64_t>(h->counts().size()) != n * h->window().bins) __builtin_trap();
  const std::vector<float> table = h->SolveTable();
  if (static_cast<int64_t>(table.size()) != (k - 1) * n) __builtin_trap();
  for (float t : table) {
    if (std::isnan(t) || t < 0.0f || (t > 1.0f && !std::isinf(t))) __builtin_trap();
  }
  return 0;
}
