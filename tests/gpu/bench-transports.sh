#!/usr/bin/env bash
# GPU weight transports (issue 7) against their same-run ceilings: NCCL push vs raw NCCL broadcast
# and a per-tensor peer, CUDA IPC push vs a device-to-device copy, per-tensor overhead of 10,000
# small tensors. tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results:
# OUT_DIR/bench-transports.json and OUT_DIR/bench-transports.txt. Needs torch and CuPy; with one GPU
# the NCCL parts are skipped and the online quantization formats go by CUDA IPC.
#
# The daemon must load the NCCL that ships with PyTorch (the trainer's): bench_push.py starts it
# with LD_LIBRARY_PATH=$(python3 -m rolloutd.trainer --nccl-lib-dir), printed below.
set -euo pipefail
build=${1:?usage: bench-transports.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-transports.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
build=$(cd "$build" && pwd)
py=$(command -v python3)
export ROLLOUTD_SOURCE_ROOT=${ROLLOUTD_SOURCE_ROOT:-$(pwd)}
export ROLLOUTD_BUILD_DIR=$build
export ROLLOUTD_BIN=${ROLLOUTD_BIN:-$build/daemon/rolloutd}
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -x "$ROLLOUTD_BIN" ] || ! ls "$build"/python/rolloutd/_native*.so >/dev/null 2>&1; then
  cmake --build "$build" --target rolloutd _native >"$out/bench-transports-build.log" 2>&1 || {
    echo "cannot build rolloutd and _native (see $out/bench-transports-build.log)"; tail -5 "$out/bench-transports-build.log"; exit 1; }
fi
if ! nccl_dir=$("$py" -m rolloutd.trainer --nccl-lib-dir); then
  echo "PyTorch's NCCL (site-packages/nvidia/nccl/lib) not found: the daemon could not join the trainer's groups"
  exit 1
fi
# The trainer (this Python), the raw-broadcast receiver and the daemon all load PyTorch's NCCL.
export LD_LIBRARY_PATH=$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "daemon: $ROLLOUTD_BIN, LD_LIBRARY_PATH=$nccl_dir (PyTorch's NCCL)"
"$py" -u "$ROLLOUTD_SOURCE_ROOT/tests/bench/transports/bench_push.py" --out-json "$out/bench-transports.json" \
  ${ROLLOUTD_BENCH_TRANSPORTS_ARGS:-} 2>&1 | tee "$out/bench-transports.txt"
exit "${PIPESTATUS[0]}"
