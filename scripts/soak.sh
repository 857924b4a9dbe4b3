#!/usr/bin/env bash
# The soak, opt-in: a local cluster under steady traffic for SECONDS (default 1800), every
# process's RSS, threads and open descriptors sampled every 5 s and required to stay flat after
# the warm-up (tests/services/soak_test.cc; the test command runs it for 120 s); then the
# fault campaign's long form: FAULTS random faults (default 100: kill -9 and restart, SIGSTOP
# for 1 s, SIGTERM and restart) on one replica at a time under load, 0 wrong answers and 0 past
# their deadline (tests/services/heal_test.cc; the test command runs 8); then the lying replica
# at the default twin-audit share of 1/64 (tests/services/lying_shard_test.cc; the test command
# runs it at 1/16).
# Usage: scripts/soak.sh [SECONDS] [FAULTS]   (after scripts/test.sh or a build into build/)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${MOE_BUILD_DIR:-build}
cmake --build "$BUILD" --target services_test router-svc expert-svc attention-svc
MOE_SOAK_SECONDS=${1:-1800} "$BUILD/tests/services_test" --gtest_filter='ClusterSoak.*'
MOE_HEAL_FAULTS=${2:-100} "$BUILD/tests/services_test" --gtest_filter='ClusterHeal.*'
MOE_AUDIT_SHARE=64 "$BUILD/tests/services_test" --gtest_filter='LyingShard.*'
