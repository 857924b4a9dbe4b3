#!/usr/bin/env bash
# The soak, opt-in: a local cluster under steady traffic for SECONDS (default 1800), every
# process's RSS, threads and open descriptors sampled every 5 s and required to stay flat after
# the warm-up (tests/services/soak_test.cc; the test command runs it for 120 s).
# Usage: scripts/soak.sh [SECONDS]   (after scripts/test.sh or a build into build/)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${MOE_BUILD_DIR:-build}
cmake --build "$BUILD" --target services_test router-svc expert-svc attention-svc
MOE_SOAK_SECONDS=${1:-1800} "$BUILD/tests/services_test" --gtest_filter='ClusterSoak.*'
