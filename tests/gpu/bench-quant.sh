#!/usr/bin/env bash
# Quantization kernels (MXFP4, MXFP8, UE8M0 FP8, the in-place MXFP4 layout permutation) against
# the device-to-device copy ceiling of the same run. tests/gpu/run.sh calls every bench-*.sh with
# BUILD_DIR OUT_DIR; results: OUT_DIR/bench-quant.json and OUT_DIR/bench-quant.txt.
set -euo pipefail
build=${1:?usage: bench-quant.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-quant.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
bin="$build/tests/bench/quant/quant_bench"
if [ ! -x "$bin" ]; then
  cmake --build "$build" --target quant_bench >"$out/bench-quant-build.log" 2>&1 || {
    echo "quant_bench is not built (is tests/bench/quant added to tests/bench/CMakeLists.txt?)"
    tail -5 "$out/bench-quant-build.log"
    exit 1
  }
fi
"$bin" "$out/bench-quant.json" | tee "$out/bench-quant.txt"
