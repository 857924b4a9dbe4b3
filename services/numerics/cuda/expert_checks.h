// What the CUDA experts accept, checked on the host before anything is uploaded (built with or
// without CUDA, tested on the CPU): the shapes the kernels are written for, and MXFP4 scales
// that are numbers (E8M0 0xFF is NaN; the kernels' exp2 would turn it into +Inf silently).
//
//   MOE_RETURN_IF_ERROR(ValidateCudaExperts(cfg, weights));  // then upload
#ifndef MOE_SERVICES_NUMERICS_CUDA_EXPERT_CHECKS_H_
#define MOE_SERVICES_NUMERICS_CUDA_EXPERT_CHECKS_H_

#include "absl/status/status.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"

namespace moe::numerics::cuda {

// INVALID_ARGUMENT naming what is wrong: D or I not a multiple of 64, k above 32, an expert
// range that does not match the weights, a missing array, or a NaN-coded scale (naming the
// expert, the matrix, the row and the block).
absl::Status ValidateCudaExperts(const ModelConfig& cfg, const MoeLayerWeights& weights);

}  // namespace moe::numerics::cuda

#endif  // MOE_SERVICES_NUMERICS_CUDA_EXPERT_CHECKS_H_
