#!/usr/bin/env bash
# Issue 6's decode figures against Hugging Face on gpt_oss checkpoints as a real one ships
# (BF16 dense weights, MXFP4 experts used as they are): make-test-model's default 8-layer
# hidden-1024 size and the issue's mid size (hidden 2880, 32 experts top-4, 64 / 8 heads of 64),
# each through tests/gpu/bench-engine.sh with the peer (transformers `generate`, in BF16) at
# batch 1 and 32, rolloutd at 1, 32 and 256, graphs on, no prefill. tests/gpu/run.sh calls it
# with BUILD_DIR OUT_DIR; results: OUT_DIR/gpt-oss-{h1024,h2880}/bench-engine{,-peer}.json and the
# tables on stdout. Figures in tests/bench/NOTES.md (ENGINE).
set -uo pipefail
build=${1:?usage: bench-engine-gpt-oss.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bench-engine-gpt-oss.sh BUILD_DIR OUT_DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
# Each size's whole output goes to OUT_DIR/gpt-oss-NAME.log (a pipe to tail printed nothing when the
# timeout fired while the peer's Python still held the pipe); its tail is printed after. Time
# limits from the 2026-12-02 run: h1024 took ~45 s, h2880 ~285 s (writing the 3 GB checkpoint,
# the peer, three batches), inside run.sh's 600 s per bench script.
run() {  # run NAME LIMIT_S PEER_LIMIT_S [SIZE]
  echo "== gpt_oss $1 (BF16 dense, MXFP4 experts)"
  mkdir -p "$out"
  ROLLOUTD_BENCH_ENGINE_FAMILY=gpt_oss ROLLOUTD_BENCH_ENGINE_DTYPE=bfloat16 ROLLOUTD_BENCH_ENGINE_MAKE_ARGS=--experts-mxfp4 \
  ROLLOUTD_BENCH_ENGINE_SIZE=${4:-} ROLLOUTD_BENCH_ENGINE_PEER_ARGS="--batches 1,32 --prefill 0" \
  ROLLOUTD_BENCH_ENGINE_PEER_TIMEOUT=$3 \
  ROLLOUTD_BENCH_ENGINE_ARGS="--models , --batches 1,32,256 --prefill 0 --graphs on" \
    timeout -k 5 "$2" bash "$here/tests/gpu/bench-engine.sh" "$build" "$out/gpt-oss-$1" >"$out/gpt-oss-$1.log" 2>&1
  echo "rc $?"
  tail -14 "$out/gpt-oss-$1.log"
}
run h1024 180 120
run h2880 390 240 "--layers 8 --hidden 2880 --experts 32 --top-k 4 --heads 64 --kv-heads 8 --head-dim 64 --intermediate 2880 --vocab 16384"
