#!/usr/bin/env bash
# Writes the make-test-model checkpoints behind tests/reference/hf_*_golden.json and runs
# tests/reference/hf_golden.py (transformers on the GPU host) over them; the goldens land in
# OUT_DIR, to be committed under tests/reference/ (hf_fidelity_test.cpp reads them and checks
# that make-test-model still writes the same checkpoint, by CRC-32).
#   tests/gpu/hf-model-goldens.sh BUILD_DIR OUT_DIR [NAME ...]   (default: every golden)
set -euo pipefail
build=${1:?usage: hf-model-goldens.sh BUILD_DIR OUT_DIR [NAME ...]}
out=${2:?usage: hf-model-goldens.sh BUILD_DIR OUT_DIR [NAME ...]}
shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
mk="$build/daemon/rolloutctl/rolloutctl"
[ -x "$mk" ] || cmake --build "$build" --target rolloutctl >/dev/null
py=$(command -v python3)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--hidden 64 --experts 8 --top-k 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 256 --dtype bfloat16)
declare -A spec=(
  [hf_qwen3_moe_golden]="--family qwen3_moe --layers 2 --intermediate 32 --seed 20261130"
  [hf_qwen3_moe_dense_golden]="--family qwen3_moe --layers 3 --intermediate 32 --mlp-only-layers 1 --seed 20261201"
  [hf_gpt_oss_golden]="--family gpt_oss --layers 2 --intermediate 64 --seed 20261202"
  # Four layers, a window of 8: the 12-token prompt and the 32-token continuation run past it.
  [hf_gpt_oss_sw8_golden]="--family gpt_oss --layers 4 --intermediate 64 --sliding-window 8 --seed 20261203"
  # MXFP4 experts as published (*_blocks / *_scales, quantization_config mxfp4).
  [hf_gpt_oss_mxfp4_golden]="--family gpt_oss --layers 2 --intermediate 64 --experts-mxfp4 --seed 20261204"
)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${!spec[@]}")
args=()
for n in "${names[@]}"; do
  # shellcheck disable=SC2086
  "$mk" make-test-model "${common[@]}" ${spec[$n]} --out "$tmp/$n" >/dev/null
  args+=("$tmp/$n" "$out/$n.json")
done
mkdir -p "$out"
timeout 600 "$py" "$here/tests/reference/hf_golden.py" "${args[@]}"
