#include "services/dataplane/ucx_buffer_pool.h"

#include <cstdlib>

namespace moe::dataplane {

UcxBuffer::~UcxBuffer() {
  if (pool_ != nullptr) pool_->Untrack(this);
  if (memh_ != nullptr && pool_ != nullptr) {
    ucp_mem_unmap(pool_->context(), static_cast<ucp_mem_h>(memh_));
    pool_->registered.fetch_sub(1);
  }
  std::free(data_);
}

}  // namespace moe::dataplane
