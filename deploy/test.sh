#!/usr/bin/env bash
# The test command: installs what is missing, builds (CPU backend, plus the CUDA sources
# for sm_90a when nvcc exists), and runs the whole test suite. GPU tests skip without a GPU.
# Uses Debian's /usr/bin/python3 for the Python client and tests.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
deploy/install-deps.sh
if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
jobs=${ROLLOUTD_JOBS:-$(nproc)}
preset=${ROLLOUTD_PRESET:-ci}
cmake --preset "$preset"
cmake --build --preset "$preset" -j "$jobs"
ctest --preset "$preset" -j "$jobs" --timeout 900 "$@"
