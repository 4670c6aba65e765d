#!/usr/bin/env bash
# Same-run A/B of kernel source variants: one build of the tree, then each variant file swapped in
# for SRC and only the benches rebuilt (incremental: one translation unit and two links), every
# binary kept apart, then the benches run in interleaved rounds on the same machine. Variants on
# different machines differ by more than most kernel changes (METHOD.md): this is how a kernel
# change is judged here (tests/bench/NOTES.md, "Staging the token rows in batches of loads").
#   ab-kernels.sh BUILD_DIR OUT_DIR SRC VARIANT...   (on the GPU host, from the repository root;
#   a VARIANT written OTHER_SRC=FILE.cu replaces OTHER_SRC instead of SRC, so that variants of
#   two source files share one call's tree build and rounds;
#   BUILD_DIR configured for CUDA as tests/gpu/run.sh configures it)
# Scratch variants live in ab/ (git-ignored: name it in the device call's carry).
# The tree's own SRC is variant "tree"; each VARIANT.cu is named by its file name. A VARIANT that
# is a directory is a whole source tree (e.g. another commit's `git archive`, for a change that
# touches several files): it is configured and built on its own, in a build folder beside the
# benches, and named by its directory name. Environment:
#   AB_TOKENS   moe_bench --tokens (default 1,8,64,1024; empty: no MoE runs)   AB_ROUNDS  rounds (default 2)
#   AB_BATCHES  engine_bench h2880 batches (default 1,32; empty: no engine runs)
#   AB_ENGINE_ARGS  (default --quantize-experts mxfp4 --dense-bf16 1 --graphs on --prefill 0; add
#               --model-dir DIR for a checkpoint's rows too, model "ckpt")
#   AB_TESTS    gtest targets built and run for every variant before any timing, e.g.
#               "moe_parity_test moe_layer_gpu_test" (default none; a variant whose test fails
#               is still timed, and the log says FAILED)
#   AB_TEST_TREE  0: run AB_TESTS on the variants only, not on the tree (default 1)
#   AB_ENVS     space-separated VAR=VALUE settings: every variant also runs with each (one at a
#               time), named VARIANT:VAR=VALUE, e.g. AB_ENVS=ROLLOUTD_PDL=0; settings joined by
#               '+' apply together (AB_ENVS="A=1+B=2": one run with both)
#   AB_ENGINE_ENVS  0: the engine rows without the AB_ENVS settings only (settings that only the
#               MoE layer's rows exercise; default 1)
# The engine rows include each batch's greedy-token digest; the summary says whether the variants'
# tokens agree (they must, for a change meant to leave the results bit for bit the same). ab.log
# also keeps engine_bench's expert-load lines (records on: the decode passes routing asked for).
# Writes OUT_DIR/ab.log (every row), ab-build.log, ab-tests.log (AB_TESTS) and prints the per-case
# summary (tests/gpu/ab_summary.py).
# SRC is restored on exit. Run the GPU tests on whichever variant lands.
set -uo pipefail
build=${1:?usage: ab-kernels.sh BUILD_DIR OUT_DIR SRC VARIANT.cu...}
out=${2:?usage}
src=${3:?usage}
shift 3
here=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$src" ] || { echo "no such source: $src"; exit 2; }
# moe_bench refuses a token list that is not ascending; say so before any build (a call once
# spent its builds and rounds on such a list and came back without MoE rows).
prev=0
IFS=, read -r -a toks <<<"${AB_TOKENS-1,8,64,1024}"
for t in "${toks[@]}"; do
  [[ $t =~ ^[0-9]+$ ]] && [ "$t" -gt "$prev" ] || { echo "AB_TOKENS must be ascending positive counts: ${AB_TOKENS-}"; exit 2; }
  prev=$t
done
mkdir -p "$out"
log=$out/ab.log
bins=$(mktemp -d)
keep=$(mktemp)
cp "$src" "$keep"
vsrc=$src
# On exit the sources are restored and their objects removed, so that any later build (this
# call's or, on a machine kept warm, the next call's tests/gpu/run.sh) compiles the tree's code
# again instead of keeping the last variant's objects. A build in flight is stopped first (the
# timeout around it runs in its own process group and would otherwise write a variant's object
# after the cleanup). A run killed outright (SIGKILL: no trap) leaves $build/.ab-replaced behind,
# the list of sources whose objects may be a variant's; this script and run.sh's build stage
# delete those objects before building.
replaced=("$src")
for v in "$@"; do [[ $v == *=* ]] && replaced+=("${v%%=*}"); done
mkdir -p "$build"
marker=$build/.ab-replaced
drop_objects() {  # drop_objects FILE...: their objects in $build (rebuilt by the next build)
  local f
  for f in "$@"; do find "$build" -name "$(basename "$f").o" -delete 2>/dev/null; done
}
if [ -f "$marker" ]; then
  mapfile -t stale <"$marker"
  drop_objects "${stale[@]}"
  replaced+=("${stale[@]}")
fi
printf '%s\n' "${replaced[@]}" >"$marker"
bpid=
build_targets() {  # build_targets LIMIT_S BUILD_DIR: the targets, in the background so a trap can stop it
  timeout "$1" cmake --build "$2" -j "$(nproc)" --target "${targets[@]}" >>"$out/ab-build.log" 2>&1 &
  bpid=$!
  wait "$bpid"
  local rc=$?
  bpid=
  return $rc
}
restore() {
  if [ -n "$bpid" ]; then kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null; fi
  cp "$keep" "$src"
  [ "$vsrc" = "$src" ] || cp "$bins/other-src" "$vsrc"
  drop_objects "${replaced[@]}"
  rm -f "$marker"
  rm -rf "$bins" "$keep"
}
trap restore EXIT
targets=(engine_bench moe_bench)
read -r -a tests <<<"${AB_TESTS:-}"
targets+=("${tests[@]}")
save() {  # save NAME [BUILD]: the built benches under $bins/NAME, and run AB_TESTS on it
  local from=${2:-$build}
  mkdir -p "$bins/$1"
  cp "$from/tests/bench/engine/engine_bench" "$from/tests/bench/moe/moe_bench" "$bins/$1/"
  if [ "$1" = tree ] && [ "${AB_TEST_TREE:-1}" = 0 ]; then return; fi
  for t in "${tests[@]}"; do
    bin=$(find "$from/tests" -name "$t" -type f -perm -u+x | head -1)
    if [ -z "$bin" ]; then echo "test $t ($1): not built" | tee -a "$out/ab-tests.log"; continue; fi
    if timeout 300 "$bin" >"$bins/test.log" 2>&1; then
      echo "test $t ($1): passed" | tee -a "$out/ab-tests.log"
    else
      echo "test $t ($1): FAILED (rc $?)" | tee -a "$out/ab-tests.log"
      grep -E "FAILED|Failure|error" "$bins/test.log" | head -30 | tee -a "$out/ab-tests.log"
    fi
  done
}
# The sources a variant replaces are rebuilt for the tree: on a machine kept warm between device
# calls the build folder stays but the tree is copied afresh with its old times, so a variant's
# objects left by a call from before the exit trap's cleanup look newer than the restored source
# and would be taken as the tree's (seen 2026-12-06: a "tree" column that was the call before's
# router variant).
for f in "${replaced[@]}"; do [ -f "$f" ] && touch "$f"; done
: >"$out/ab-build.log"
build_targets 600 "$build" || { echo "build of the tree failed"; tail -20 "$out/ab-build.log"; exit 1; }
save tree
names=(tree)
for v in "$@"; do
  name=$(basename "$v" .cu)
  if [ -d "$v" ]; then  # a whole tree: its own configure and build
    vb="$bins/build-$name"
    if cmake -S "$v" -B "$vb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROLLOUTD_ENABLE_CUDA=ON \
         -DCMAKE_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$(command -v python3)" >>"$out/ab-build.log" 2>&1 &&
       build_targets 400 "$vb"; then
      save "$name" "$vb"
      names+=("$name")
    else
      echo "variant $name (a tree) failed to build (skipped):"; grep -E "error" "$out/ab-build.log" | tail -5
    fi
    continue
  fi
  # OTHER_SRC=VARIANT.cu: this variant replaces another source than SRC (restored after its build;
  # name such variants last, so that restoring them costs no rebuild of the others).
  vsrc=$src
  if [[ $v == *=* ]]; then
    vsrc=${v%%=*}
    v=${v#*=}
    name=$(basename "$v" .cu)
    [ -f "$vsrc" ] || { echo "variant $name: no such source $vsrc (skipped)"; vsrc=$src; continue; }
    cp "$vsrc" "$bins/other-src"
  fi
  if [ ! -f "$v" ] || ! cp "$v" "$vsrc"; then
    echo "variant $name: cannot read $v (skipped)"
    if [ "$vsrc" != "$src" ]; then cp "$bins/other-src" "$vsrc"; vsrc=$src; fi
    continue
  fi
  if build_targets 300 "$build"; then
    save "$name"
    names+=("$name")
  else
    echo "variant $name failed to build (skipped):"; grep -E "error" "$out/ab-build.log" | tail -5
  fi
  if [ "$vsrc" != "$src" ]; then cp "$bins/other-src" "$vsrc"; vsrc=$src; else cp "$keep" "$src"; fi
done
cp "$keep" "$src"
: >"$log"
read -r -a envs <<<"${AB_ENVS:-}"
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for n in "${names[@]}"; do
    for e in "" "${envs[@]}"; do
      label=$n${e:+:$e}
      if [ -n "${AB_TOKENS-1,8,64,1024}" ]; then
        echo "== moe $label round $r" >>"$log"
        # shellcheck disable=SC2086
        env ${e//+/ } timeout 120 "$bins/$n/moe_bench" "$bins/moe.json" --tokens "${AB_TOKENS:-1,8,64,1024}" \
          2>"$bins/moe.err" | grep -E " (bf16|mxfp8) " >>"$log"
        # A failed run says why in the log instead of leaving the case without rows.
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "moe_bench failed: $(tail -3 "$bins/moe.err" | tr '\n' ' ')" >>"$log"; }
      fi
      if [ -n "${AB_BATCHES-1,32}" ] && { [ -z "$e" ] || [ "${AB_ENGINE_ENVS:-1}" != 0 ]; }; then
        echo "== engine $label round $r" >>"$log"
        # shellcheck disable=SC2086
        env ${e//+/ } timeout 180 "$bins/$n/engine_bench" --models h2880 --batches "${AB_BATCHES-1,32}" \
          ${AB_ENGINE_ARGS:---quantize-experts mxfp4 --dense-bf16 1 --graphs on --prefill 0} 2>&1 \
          | grep -E "^(h2880|ckpt) +[0-9]+ +(on|off) +((on|off) |floor |expert load)" >>"$log"
      fi
    done
  done
done
python3 "$here/tests/gpu/ab_summary.py" "$log"
