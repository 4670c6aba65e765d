#!/usr/bin/env bash
# Everything the GPU host runs, in stages (ROLLOUTD_GPU_STAGES, default all, comma-separated):
#   goldens  torch goldens for the numeric formats, Hugging Face goldens for the MoE blocks
#   build    configure + build (CUDA, sm_90a) into $ROLLOUTD_GPU_BUILD (default build/gpu)
#   test     ctest -L gpu (ROLLOUTD_GPU_TESTS: a -R regex; with ROLLOUTD_GPU_ALL_TESTS=1, the rest of the suite too)
#   bench    every tests/gpu/bench-*.sh
# Results go under $OUT in few files (the device tool returns at most 8): run.log (every step
# and every bench's text table), ctest-gpu.log, ctest-rest.log, bench-*.json, *.rdqg goldens.
#
# On the device machine, from the repository root:
#   source .deps/gpu/env.sh && tests/gpu/run.sh
set -uo pipefail
OUT=${OUT:-/tmp/rolloutd-gpu-out}
mkdir -p "$OUT"
log=$OUT/run.log
stages=",${ROLLOUTD_GPU_STAGES:-goldens,build,test,bench},"
# NVLink multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=$(command -v python3)
build=${ROLLOUTD_GPU_BUILD:-build/gpu}
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
has() { [[ $stages == *",$1,"* ]]; }
rc=0

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; "$py" --version; } >>"$log" 2>&1

if has goldens; then
  step "torch goldens (tests/reference/quant/make_torch_golden.py)"
  timeout 300 "$py" tests/reference/quant/make_torch_golden.py >>"$log" 2>&1 && cp tests/reference/quant/torch_golden.rdqg "$OUT/" \
    || echo "torch golden generation failed (see run.log)" | tee -a "$log"
  step "Hugging Face MoE goldens (tests/reference/moe/make_hf_moe_golden.py)"
  timeout 300 "$py" tests/reference/moe/make_hf_moe_golden.py >>"$log" 2>&1 && cp tests/reference/moe/hf_moe_golden.rdqg "$OUT/" \
    || echo "HF MoE golden generation failed (see run.log)" | tee -a "$log"
fi
if has build; then
  step "configure"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROLLOUTD_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$py" >>"$log" 2>&1 \
    || { tail -40 "$log"; exit 1; }
  step "build"
  # Objects an A/B killed outright may have left from its variants (tests/gpu/ab-kernels.sh
  # lists their sources there): rebuilt from the tree's sources.
  if [ -f "$build/.ab-replaced" ]; then
    while read -r f; do [ -n "$f" ] && find "$build" -name "$(basename "$f").o" -delete; done <"$build/.ab-replaced"
  fi
  timeout 1200 cmake --build "$build" -j "$(nproc)" >>"$log" 2>&1 \
    || { grep -E "error|FAILED" "$log" | head -40; exit 1; }
  rm -f "$build/.ab-replaced"
fi
if has test; then
  step "ctest -L gpu"
  # ROLLOUTD_GPU_TESTS: a ctest -R regex to run only some of them.
  timeout "${ROLLOUTD_GPU_TEST_TIMEOUT:-900}" ctest --test-dir "$build" -L gpu ${ROLLOUTD_GPU_TESTS:+-R "$ROLLOUTD_GPU_TESTS"} \
    --output-on-failure >"$OUT/ctest-gpu.log" 2>&1
  rc=$?
  grep -E "Test +#|tests passed|FAILED|Failed" "$OUT/ctest-gpu.log" | tail -30
  if [ "${ROLLOUTD_GPU_ALL_TESTS:-0}" = 1 ]; then
    step "ctest (everything else, on the GPU host's toolchain and Python)"
    timeout 900 ctest --test-dir "$build" -LE gpu -j 16 --output-on-failure >"$OUT/ctest-rest.log" 2>&1
    tail -12 "$OUT/ctest-rest.log"
  fi
fi
if has bench; then
  for b in tests/gpu/bench-*.sh; do
    [ -e "$b" ] || continue
    # ROLLOUTD_GPU_BENCHES="moe,transports" runs only those.
    name=$(basename "$b" .sh); name=${name#bench-}
    if [ -n "${ROLLOUTD_GPU_BENCHES:-}" ] && [[ ",$ROLLOUTD_GPU_BENCHES," != *",$name,"* ]]; then continue; fi
    step "bench $b"
    timeout "${ROLLOUTD_GPU_BENCH_TIMEOUT:-600}" bash "$b" "$build" "$OUT" >>"$log" 2>&1
    t="$OUT/$(basename "$b" .sh).txt"
    if [ -f "$t" ]; then cat "$t" >>"$log"; tail -25 "$t"; rm -f "$t"; fi
  done
  rm -f "$OUT"/*-build.log
fi
exit $rc
