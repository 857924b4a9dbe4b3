#include "services/common/version.h"

namespace moe {

const char* BuildVersion() { return MOE_VERSION; }

}  // namespace moe
