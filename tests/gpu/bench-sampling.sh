#!/usr/bin/env bash
# Sampling on the device against the logits copy plus host sampling, at Qwen3's vocabulary, rows
# 1, 32 and 256, greedy and temperature 1 with filters (tests/bench/device_sampling_bench.cpp).
# tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results:
# OUT_DIR/bench-sampling.json and the table in run.log. tests/bench/NOTES.md ("Device sampling")
# keeps the figures.
set -euo pipefail
build=${1:?usage: bench-sampling.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-sampling.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
bin="$build/tests/bench/device_sampling_bench"
[ -x "$bin" ] || cmake --build "$build" --target device_sampling_bench >"$out/bench-sampling-build.log" 2>&1
timeout 300 "$bin" --json "$out/bench-sampling.json" | tee "$out/bench-sampling.txt"
