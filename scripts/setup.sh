#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, only those that are missing.
# Idempotent; needs root (CI and the dev machines run as root) or sudo.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ ccache clang libclang-rt-14-dev clang-format git
  libabsl-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-numpy gnuplot-nox libopenblas-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler prometheus-cpp-dev
  prometheus chromium
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# Node.js + npm drive the browser test (playwright-core); machines of this kind ship them, so the
# Debian ones only come in where there is none.
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi
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
