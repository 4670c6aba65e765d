#!/usr/bin/env bash
# The MoE layer (MXFP4 experts x bf16 / MXFP8 activations) against the HBM floor and a same-run
# torch._grouped_mm BF16 peer, gpt-oss-120b and Qwen3-30B-A3B shapes, 1 to 8192 tokens.
# tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results: OUT_DIR/bench-moe.json
# and OUT_DIR/bench-moe.txt (the peer's raw timings stay in a temporary folder: the device tool
# returns only a few files). tests/bench/moe/NOTES.md explains the columns and the floor.
set -euo pipefail
build=${1:?usage: bench-moe.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-moe.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
bin="$build/tests/bench/moe/moe_bench"
if [ ! -x "$bin" ]; then
  cmake --build "$build" --target moe_bench >"$out/bench-moe-build.log" 2>&1 || {
    echo "moe_bench is not built (is tests/bench/moe added to tests/bench/CMakeLists.txt?)"
    tail -5 "$out/bench-moe-build.log"
    exit 1
  }
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$(command -v python3 || true)
peer_args=()
if [ -n "$py" ] && timeout 300 "$py" "$here/tests/bench/moe/torch_moe_peer.py" --tsv "$tmp/peer.tsv" 2>"$tmp/peer.log"; then
  peer_args=(--peer "$tmp/peer.tsv")
else
  echo "torch peer unavailable or failed; reporting without it:"
  tail -5 "$tmp/peer.log" 2>/dev/null || true
fi
"$bin" "$out/bench-moe.json" ${peer_args[@]+"${peer_args[@]}"} 2>"$tmp/bench.log" | tee "$out/bench-moe.txt" || {
  tail -20 "$tmp/bench.log"
  exit 1
}
