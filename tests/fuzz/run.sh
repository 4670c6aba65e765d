#!/usr/bin/env bash
# Runs every fuzz target for a bounded time and fails on any finding.
#
#   tests/fuzz/run.sh SECONDS [BUILD_DIR]      (BUILD_DIR: build/fuzz, the fuzz preset's)
#
# Build first: cmake --preset fuzz && cmake --build --preset fuzz   (clang, libFuzzer,
# ASan + UBSan). Each target starts from the committed tests/fuzz/corpus/<target>/ (seeds
# and regression inputs), seeds made from the current golden files (make_seeds.py), and
# the corpus grown by earlier runs in BUILD_DIR/fuzz-work/corpus/<target>/ (kept there,
# never written into the source tree). A finding (crash, sanitizer report, leak, timeout,
# out-of-memory, failed FUZZ_CHECK) stops that target, leaves the input in
# BUILD_DIR/fuzz-work/artifacts/<target>/, and makes this script exit 1. To keep it as a
# regression input: minimise it (fuzz_<target> -minimize_crash=1 -runs=20000 FILE), fix the
# bug, and commit the input as tests/fuzz/corpus/<target>/regress-<what>; the ctest test
# fuzz_corpus_<target> replays it from then on.
#
# Writes BUILD_DIR/fuzz-work/summary.tsv: target, seconds, executions, exec/s, corpus
# entries, accepted and refused inputs (the tallies the targets print), findings.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
seconds=${1:?usage: run.sh SECONDS [BUILD_DIR]}
build=${2:-$root/build/fuzz}
bin=$build/tests/fuzz
work=$build/fuzz-work
targets=${ROLLOUTD_FUZZ_TARGETS:-request incoming bucket config safetensors}
python=${PYTHON:-/usr/bin/python3}

rm -rf "$work/seeds" "$work/artifacts" "$work/logs"
mkdir -p "$work/seeds" "$work/artifacts" "$work/logs"
"$python" "$root/tests/fuzz/make_seeds.py" "$work/seeds" --dicts

# Largest input per target: a bucket table or a multi-frame message needs room; argv does not.
max_len() {
  case $1 in
    request|incoming) echo 65536 ;;
    bucket|safetensors) echo 8192 ;;
    *) echo 1024 ;;
  esac
}

printf 'target\tseconds\texecutions\texec_per_s\tcorpus\taccepted\trefused\tfindings\n' > "$work/summary.tsv"
failed=0
for t in $targets; do
  exe=$bin/fuzz_$t
  if [ ! -x "$exe" ]; then
    echo "run.sh: $exe is missing (cmake --build --preset fuzz)" >&2
    exit 2
  fi
  mkdir -p "$work/corpus/$t" "$work/artifacts/$t"
  dict=()
  [ -f "$work/seeds/$t.dict" ] && dict=(-dict="$work/seeds/$t.dict")
  log=$work/logs/$t.log
  echo "== fuzz_$t for ${seconds}s"
  rc=0
  # detect_leaks: libFuzzer checks for leaks per input; ASan/UBSan abort on the first report.
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$(max_len "$t")" \
      -print_final_stats=1 -artifact_prefix="$work/artifacts/$t/" "${dict[@]}" \
      "$work/corpus/$t" "$work/seeds/$t" "$root/tests/fuzz/corpus/$t" > "$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  corpus=$(find "$work/corpus/$t" -type f | wc -l)
  tally=$(grep -o 'fuzz-tally [a-z]*: accepted [0-9]* refused [0-9]*' "$log" | tail -1 || true)
  accepted=$(echo "$tally" | sed -n 's/.*accepted \([0-9]*\).*/\1/p')
  refused=$(echo "$tally" | sed -n 's/.*refused \([0-9]*\).*/\1/p')
  findings=$(find "$work/artifacts/$t" -type f | wc -l)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$seconds" "${execs:-?}" "${rate:-?}" "$corpus" \
    "${accepted:-?}" "${refused:-?}" "$findings" >> "$work/summary.tsv"
  if [ "$rc" -ne 0 ] || [ "$findings" -ne 0 ]; then
    failed=1
    echo "!! fuzz_$t: exit $rc, $findings finding(s) in $work/artifacts/$t/" >&2
    grep -E -A40 '==[0-9]+==ERROR|runtime error|FUZZ_CHECK failed|deadly signal|Test unit written' "$log" | head -80 >&2 || tail -40 "$log" >&2
  else
    echo "   ${execs:-?} executions (${rate:-?}/s), corpus $corpus, accepted ${accepted:-?}, refused ${refused:-?}"
  fi
done
column -t -s $'\t' "$work/summary.tsv" 2>/dev/null || cat "$work/summary.tsv"
exit $failed
