#!/usr/bin/env bash
# Everything the GPU host runs in one call: build (CUDA, sm_90a), the `gpu`-labelled tests,
# then the GPU benchmarks. Logs and JSON results go under $OUT (the device tool returns them).
#
# On the device machine, from the repository root:
#   source .deps/gpu/env.sh && tests/gpu/run.sh
# The staged folder (.deps/gpu, made by ../shared/gpu/stage-deps.sh) supplies ZeroMQ,
# msgpack-c, spdlog, prometheus-cpp, ... which that host lacks.
set -uo pipefail
OUT=${OUT:-/tmp/rolloutd-gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=$(command -v python3)
build=build/gpu
step() { echo "=== $*"; }

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } >"$OUT/host.txt" 2>&1
step "configure"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROLLOUTD_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$py" >"$OUT/configure.log" 2>&1 \
  || { tail -40 "$OUT/configure.log"; exit 1; }
step "build"
timeout 1200 cmake --build "$build" -j "$(nproc)" >"$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
step "ctest -L gpu"
timeout 900 ctest --test-dir "$build" -L gpu --output-on-failure >"$OUT/ctest-gpu.log" 2>&1
rc=$?
tail -30 "$OUT/ctest-gpu.log"
if [ "${ROLLOUTD_GPU_ALL_TESTS:-0}" = 1 ]; then
  step "ctest (everything else, on the GPU host's toolchain)"
  timeout 900 ctest --test-dir "$build" -LE gpu -j 16 --output-on-failure >"$OUT/ctest-rest.log" 2>&1
  tail -15 "$OUT/ctest-rest.log"
fi
for b in tests/gpu/bench-*.sh; do
  [ -e "$b" ] || continue
  step "bench $b"
  timeout 600 bash "$b" "$build" "$OUT" 2>&1 | tail -40
done
exit $rc
