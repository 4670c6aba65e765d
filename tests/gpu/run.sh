#!/usr/bin/env bash
# Everything the GPU host runs in one call: torch goldens, build (CUDA, sm_90a), the
# `gpu`-labelled tests, optionally the rest of the suite on that host's toolchain and Python,
# then the GPU benchmarks. Results go under $OUT in a few files (the device tool returns at
# most 8): run.log (every step), ctest-gpu.log, ctest-rest.log, bench-*.json, torch_golden.rdqg.
#
# On the device machine, from the repository root:
#   source .deps/gpu/env.sh && tests/gpu/run.sh
# The staged folder (.deps/gpu, made by ../shared/gpu/stage-deps.sh) supplies ZeroMQ,
# msgpack-c, spdlog, prometheus-cpp, ... which that host lacks.
set -uo pipefail
OUT=${OUT:-/tmp/rolloutd-gpu-out}
mkdir -p "$OUT"
log=$OUT/run.log
# NVLink multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=$(command -v python3)
build=build/gpu
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; "$py" --version; } >>"$log" 2>&1

step "torch goldens (tests/reference/quant/make_torch_golden.py)"
timeout 300 "$py" tests/reference/quant/make_torch_golden.py >>"$log" 2>&1 && cp tests/reference/quant/torch_golden.rdqg "$OUT/" \
  || echo "torch golden generation failed (see run.log)" | tee -a "$log"

step "configure"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROLLOUTD_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$py" >>"$log" 2>&1 \
  || { tail -40 "$log"; exit 1; }
step "build"
timeout 1200 cmake --build "$build" -j "$(nproc)" >>"$log" 2>&1 \
  || { grep -E "error|FAILED" "$log" | head -40; exit 1; }
step "ctest -L gpu"
timeout 900 ctest --test-dir "$build" -L gpu --output-on-failure >"$OUT/ctest-gpu.log" 2>&1
rc=$?
tail -25 "$OUT/ctest-gpu.log"
if [ "${ROLLOUTD_GPU_ALL_TESTS:-0}" = 1 ]; then
  step "ctest (everything else, on the GPU host's toolchain and Python)"
  timeout 900 ctest --test-dir "$build" -LE gpu -j 16 --output-on-failure >"$OUT/ctest-rest.log" 2>&1
  tail -12 "$OUT/ctest-rest.log"
fi
for b in tests/gpu/bench-*.sh; do
  [ -e "$b" ] || continue
  step "bench $b"
  timeout 600 bash "$b" "$build" "$OUT" >>"$log" 2>&1
  tail -30 "$OUT/$(basename "$b" .sh).txt" 2>/dev/null
done
exit $rc
