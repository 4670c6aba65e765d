#!/usr/bin/env bash
# The engine with CUDA graphs on vs off: decode tokens/s at batch 1, 32 and 256 on the embedded
# tiny model, a mid-size random model and a make-test-model qwen3_moe checkpoint of the same
# size, which Hugging Face `generate` also runs here (tests/bench/engine/hf_peer.py, the
# same-run peer); the decode floor; the first decode step after a full weight update against
# the steady state; the routed-expert capture overhead (records on vs off).
# tests/gpu/run.sh calls every bench-*.sh with BUILD_DIR OUT_DIR; results:
# OUT_DIR/bench-engine.json (+ bench-engine-peer.json) and the table in run.log. The checkpoint's
# family: ROLLOUTD_BENCH_ENGINE_FAMILY (qwen3_moe or gpt_oss); more make-test-model arguments:
# ROLLOUTD_BENCH_ENGINE_MAKE_ARGS (e.g. --experts-mxfp4); its shape: ROLLOUTD_BENCH_ENGINE_SIZE; its
# dtype (and the peer's): ROLLOUTD_BENCH_ENGINE_DTYPE (float32, the default, or bfloat16: rolloutd's
# dense GEMMs then run in BF16, as a real gpt-oss checkpoint's do).
# tests/bench/NOTES.md ("CUDA GRAPHS", "ENGINE") keeps the figures. Extra arguments:
# ROLLOUTD_BENCH_ENGINE_ARGS (e.g. --quantize-experts mxfp4: every model's routed experts as MXFP4,
# the checkpoint's quantized on load; the Hugging Face peer runs it unquantized).
set -euo pipefail
build=${1:?usage: bench-engine.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-engine.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
bin="$build/tests/bench/engine/engine_bench"
[ -x "$bin" ] || cmake --build "$build" --target engine_bench rolloutctl >"$out/bench-engine-build.log" 2>&1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ckpt_args=()
# ROLLOUTD_BENCH_ENGINE_FAMILY: qwen3_moe (default) or gpt_oss, the same mid size.
family=${ROLLOUTD_BENCH_ENGINE_FAMILY:-qwen3_moe}
# ROLLOUTD_BENCH_ENGINE_SIZE: the checkpoint's shape arguments (default: the mid size below).
size=${ROLLOUTD_BENCH_ENGINE_SIZE:-"--layers 8 --hidden 1024 --experts 32 --top-k 4 --heads 16 --kv-heads 4 --head-dim 64 --intermediate 512 --vocab 16384"}
dtype=${ROLLOUTD_BENCH_ENGINE_DTYPE:-float32}
# shellcheck disable=SC2086
if "$build/daemon/rolloutctl/rolloutctl" make-test-model --family "$family" $size --dtype "$dtype" --seed 3 \
     ${ROLLOUTD_BENCH_ENGINE_MAKE_ARGS:-} --out "$tmp/$family-mid" >"$tmp/make.log" 2>&1; then
  ckpt_args=(--model-dir "$tmp/$family-mid")
  py=$(command -v python3 || true)
  # shellcheck disable=SC2086
  if [ -n "$py" ] && timeout "${ROLLOUTD_BENCH_ENGINE_PEER_TIMEOUT:-420}" "$py" "$here/tests/bench/engine/hf_peer.py" \
       --model "$tmp/$family-mid" --dtype "$dtype" ${ROLLOUTD_BENCH_ENGINE_PEER_ARGS:-} \
       --json "$out/bench-engine-peer.json" 2>&1 | tail -5; then
    ckpt_args+=(--peer "$out/bench-engine-peer.json")
  else
    echo "Hugging Face peer unavailable or failed; reporting without it"
  fi
else
  echo "make-test-model failed:"; tail -5 "$tmp/make.log"
fi
# shellcheck disable=SC2086
timeout 900 "$bin" --json "$out/bench-engine.json" ${ckpt_args[@]+"${ckpt_args[@]}"} ${ROLLOUTD_BENCH_ENGINE_ARGS:-}
