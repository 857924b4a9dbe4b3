#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, only those that are missing.
# Idempotent; needs root (CI and the dev machines run as root) or sudo.
# Usage: scripts/setup.sh [--build-only]
set -euo pipefail

# What building the services needs (the container image's build stage installs only these:
# scripts/setup.sh --build-only).
BUILD_PACKAGES=(
  cmake ninja-build g++ ccache git
  libabsl-dev nlohmann-json3-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler prometheus-cpp-dev
  libmicrohttpd-dev libspdlog-dev libsqlite3-dev
  libucx-dev libssl-dev pkg-config libgoogle-perftools-dev
)
# What the tests and benchmarks need on top: the fuzzer and formatter, test frameworks, the
# NumPy reference, real peers (Prometheus, Chromium), the chart renderer (Go + sprig + yaml).
TEST_PACKAGES=(
  clang libclang-rt-14-dev clang-format
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-numpy python3-grpcio python3-protobuf python3-venv python3-pip python3-setuptools
  python3-wheel python3-torch gnuplot-nox libopenblas-dev ucx-utils
  prometheus chromium etcd-server
  golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev
)
PACKAGES=("${BUILD_PACKAGES[@]}")
if [ "${1:-}" != "--build-only" ]; then PACKAGES+=("${TEST_PACKAGES[@]}"); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# Node.js + npm drive the browser test (playwright-core); machines of this kind ship them, so the
# Debian ones only come in where there is none.
if [ "${1:-}" != "--build-only" ] && ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
