// The build's version: `git describe --always --dirty` of the commit the build was configured
// from ("dev" outside a git checkout). Every binary prints it for --version; it is the version
// label of moe_build_info and the Open Inference Protocol's ServerMetadata.version.
//
//   std::printf("%s %s\n", "moe-cli", moe::BuildVersion());
#ifndef MOE_SERVICES_COMMON_VERSION_H_
#define MOE_SERVICES_COMMON_VERSION_H_

namespace moe {

const char* BuildVersion();

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_VERSION_H_
