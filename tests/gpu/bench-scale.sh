#!/usr/bin/env bash
# Scale run (issue 11) on every GPU of this host (N of them): NCCL weight sync to the N-1 daemons of
# GPUs 1..N-1 against a raw N-rank NCCL broadcast, IPC to a daemon colocated with the trainer on
# GPU 0 against a device copy, fleet rollouts over all N daemons against N x one daemon.
# tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results:
# OUT_DIR/bench-scale.json and OUT_DIR/bench-scale.txt. Needs torch and CuPy (the GPU host's
# python3); with fewer than two GPUs it says so and exits 0.
#
# Builds only what it runs (the daemon and the Python transport), configuring BUILD_DIR as
# run.sh does when nothing is there, so `ROLLOUTD_GPU_STAGES=bench` alone works on a bare host.
# ROLLOUTD_BENCH_SCALE_DEADLINE_S (default 540): this script's whole budget, build included; the
# Python run gets what is left less 15 s and, past it, prints its stacks and partial results.
# ROLLOUTD_BENCH_SCALE_ARGS: more arguments for run_scale.py (--sizes-gib 8,32 --num-requests 4096 ...).
set -euo pipefail
build=${1:?usage: bench-scale.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-scale.sh BUILD_DIR OUT_DIR}
mkdir -p "$out" "$build"
build=$(cd "$build" && pwd)
txt=$out/bench-scale.txt
py=$(command -v python3)
budget=${ROLLOUTD_BENCH_SCALE_DEADLINE_S:-540}

gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null \
       || { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; })
if [ "${gpus:-0}" -lt 2 ]; then
  echo "bench-scale: skipped, the scale run needs at least 2 GPUs (this host shows ${gpus:-0})" | tee "$txt"
  exit 0
fi

export ROLLOUTD_SOURCE_ROOT=${ROLLOUTD_SOURCE_ROOT:-$(pwd)}
export ROLLOUTD_BUILD_DIR=$build
export ROLLOUTD_BIN=${ROLLOUTD_BIN:-$build/daemon/rolloutd}
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -x "$ROLLOUTD_BIN" ] || ! ls "$build"/python/rolloutd/_native*.so >/dev/null 2>&1; then
  blog=$out/bench-scale-build.log
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$ROLLOUTD_SOURCE_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROLLOUTD_ENABLE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$py" >"$blog" 2>&1 || {
      echo "cannot configure $build (see $blog)"; tail -20 "$blog"; exit 1; }
  fi
  cmake --build "$build" -j "$(nproc)" --target rolloutd _native >>"$blog" 2>&1 || {
    echo "cannot build rolloutd and _native (see $blog)"; grep -E "error|FAILED" "$blog" | head -20; exit 1; }
  echo "bench-scale: built rolloutd and _native in ${SECONDS} s"
fi
if ! nccl_dir=$("$py" -m rolloutd.trainer --nccl-lib-dir); then
  echo "PyTorch's NCCL (site-packages/nvidia/nccl/lib) not found: the daemons could not join the trainer's groups"
  exit 1
fi
# The trainer (this Python), the raw-broadcast ranks and the daemons all load PyTorch's NCCL.
export LD_LIBRARY_PATH=$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
left=$((budget - SECONDS - 15))
if [ "$left" -lt 60 ]; then
  echo "bench-scale: only ${left} s left of ${budget} s after the build: not started" | tee "$txt"
  exit 1
fi
echo "bench-scale: N = $gpus GPUs, daemon $ROLLOUTD_BIN, LD_LIBRARY_PATH=$nccl_dir (PyTorch's NCCL), deadline ${left} s"
PYTHONUNBUFFERED=1 "$py" -u "$ROLLOUTD_SOURCE_ROOT/tests/bench/scale/run_scale.py" --out-json "$out/bench-scale.json" \
  --deadline-s "$left" ${ROLLOUTD_BENCH_SCALE_ARGS:-} 2>&1 | tee "$txt"
exit "${PIPESTATUS[0]}"
