#!/usr/bin/env bash
# The test command of README.md: installs what is missing, checks formatting, builds with
# warnings as errors, runs
# a bounded libFuzzer run of the safetensors parser, then every test (unit tests, the
# NumPy-vs-C++ reference test, multi-process cluster tests, a real Prometheus and a real
# Chromium against a local cluster) through ctest, whose summary is the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Formatting is part of the contract (STYLE.md): clang-format, Google base, 100 columns.
git ls-files '*.h' '*.cc' | xargs clang-format --dry-run --Werror
BUILD=${MOE_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DMOE_WERROR=ON >/dev/null
cmake --build "$BUILD"
scripts/fuzz.sh
# The browser test's driver (playwright-core, pinned in tests/web/package-lock.json); it drives
# Debian's /usr/bin/chromium, so no browser download.
if [ ! -d tests/web/node_modules/playwright-core ]; then
  npm ci --prefix tests/web --no-audit --no-fund --loglevel=error
fi
# The chart test's schema validator (kubernetes-models, js-yaml), pinned in tests/deploy.
if [ ! -d tests/deploy/node_modules/kubernetes-models ]; then
  npm ci --prefix tests/deploy --no-audit --no-fund --loglevel=error
fi
# The CPU kernel choice (services/numerics/cpu/kernel_choice.h) of this run, measured afresh by
# its first process and read by all the others: tests that compare a service with an
# in-process layer bit for bit need every process on the same kernels.
case "$BUILD" in
  /*) export MOE_KERNEL_CACHE="$BUILD/kernel-cache" ;;
  *) export MOE_KERNEL_CACHE="$PWD/$BUILD/kernel-cache" ;;
esac
rm -rf "$MOE_KERNEL_CACHE"
ctest --test-dir "$BUILD" --output-on-failure -j2 --timeout 900
