// Every sum of the combine step (docs/math.md section 4 step 4) lives here, so that the in-process
// layer, the expert servers and the attention node add in the same, documented order:
//  * ref::Combine, the reference: r[t] = bf16( sum_k fp32(y[t, k]) * w[t, k] ), the fp32 sum
//    over the token's experts in ascending expert id (not rank order), starting from 0.0f; each
//    product fp32(y) * w is rounded to fp32 before it is added (no FMA);
//  * PartialSums, what an expert server returns in partial-sum mode: the same sum restricted to
//    the experts it hosts, in fp32, one row per distinct token;
//  * AddPartialSums, the attention node's cross-server sum: the servers' partial sums added in
//    ascending order of their experts. Adding partial sums changes the fp32 summation order
//    (each server's subtotal is rounded first), so partial-sum mode agrees with Combine within
//    a tolerance, not bit for bit.
//
//  * CombineRows, ref::Combine's sums bit for bit (the same order, the same roundings) from each
//    pair's row where it lies, with the tokens split over a thread pool: what the in-process
//    layer and the attention node run.
//
//   ref::Combine(routing, y, latent, r);  // y: [T, k, D] in routing's slot order
//   CombineRows(routing, rows, latent, r, pool);  // rows[t * k + slot] -> that pair's row
#ifndef MOE_SERVICES_NUMERICS_COMBINE_H_
#define MOE_SERVICES_NUMERICS_COMBINE_H_

#include <cstdint>
#include <vector>

#include "services/numerics/router.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::ref {

// y: [tokens, top_k, latent] bf16, slot j of token t from expert routing.expert_ids[t*k + j]
// -> r: [tokens, latent] bf16.
void Combine(const Routing& routing, const tensor::Bf16* y, int64_t latent, tensor::Bf16* r);

}  // namespace moe::numerics::ref

namespace moe {
class ThreadPool;
}

namespace moe::numerics {

// ref::Combine from row pointers: rows[t * k + slot] is the [latent] row of that pair (not read
// for a slot the budget dropped, expert id < 0; null: zeros), wherever it lies (the attention
// node's reply buffers: no [T, k, D] copy first). Tokens run in blocks on `pool` when it is free
// (null or busy: this thread); every token's sum is ref::Combine's, bit for bit, whatever the
// split.
void CombineRows(const Routing& routing, const tensor::Bf16* const* rows, int64_t latent,
                 tensor::Bf16* r, ThreadPool* pool);

// One server's partial sums. rows y: [rows, latent] bf16 in the order the sum must run
// (ascending expert id), row i for token token_index[i] (< num_tokens) with routing weight
// weights[i] -> out: [distinct tokens, latent] fp32, one row per distinct token in ascending
// token order, each out[t] = sum over the token's rows of fp32(fp32(y) * w), from 0.0f.
// Returns the distinct tokens (ascending). Time and memory grow with rows, not num_tokens.
std::vector<int64_t> PartialSums(const tensor::Bf16* y, int64_t rows, int64_t latent,
                                 const int32_t* token_index, const float* weights,
                                 int64_t num_tokens, std::vector<float>* out);

// The cross-server sum: adds one server's partial sums part [tokens.size(), latent] (rows for
// the given tokens) into acc [num_tokens, latent] fp32. Call it per server in ascending order of
// the servers' experts; r = bf16(acc) afterwards.
void AddPartialSums(const float* part, const std::vector<int64_t>& tokens, int64_t latent,
                    float* acc);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_COMBINE_H_
