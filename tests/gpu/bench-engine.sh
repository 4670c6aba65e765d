#!/usr/bin/env bash
# The engine with CUDA graphs on vs off: decode tokens/s at batch 1, 32 and 256 on the embedded
# tiny model and a mid-size random model, the first decode step after a full weight update
# against the steady state, and the routed-expert capture overhead (records on vs off).
# tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results:
# OUT_DIR/bench-engine.json and the table in run.log. tests/bench/NOTES.md ("CUDA GRAPHS")
# keeps the figures. Extra arguments: ROLLOUTD_BENCH_ENGINE_ARGS.
set -euo pipefail
build=${1:?usage: bench-engine.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-engine.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
bin="$build/tests/bench/engine/engine_bench"
[ -x "$bin" ] || cmake --build "$build" --target engine_bench >"$out/bench-engine-build.log" 2>&1
# shellcheck disable=SC2086
timeout 900 "$bin" --json "$out/bench-engine.json" ${ROLLOUTD_BENCH_ENGINE_ARGS:-}
