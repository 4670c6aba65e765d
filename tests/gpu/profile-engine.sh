#!/usr/bin/env bash
# Where a decode step's time goes: Nsight Compute (ncu, kernel duration only, clocks left alone)
# over a window of engine_bench decode steps, graphs off, summed per kernel name per step
# (tests/gpu/ncu_summary.py). Not part of run.sh's benches: run it by hand on the GPU host.
#   profile-engine.sh BUILD_DIR OUT_DIR [MODEL [BATCHES [ENGINE_BENCH ARGS...]]]
# e.g. profile-engine.sh build/gpu $OUT h2880 1,32,256 --quantize-experts mxfp4
# Writes OUT_DIR/profile-<model>-b<batch>.txt (and the raw .csv with ROLLOUTD_PROFILE_KEEP_CSV=1). The window skips the warm-up and the first
# run's prefill (ROLLOUTD_PROFILE_SKIP kernels, default 3000) and covers ROLLOUTD_PROFILE_COUNT
# kernels (default 600: a few steps).
# ROLLOUTD_PROFILE_DETAIL=REGEX: after the durations, a second ncu pass per batch over
# ROLLOUTD_PROFILE_DETAIL_COUNT (default 4) launches of the kernels whose names match REGEX (e.g.
# 'decode_gemm|router|permute|sample_kernel'), past ROLLOUTD_PROFILE_DETAIL_SKIP (default 200) of
# them, with the speed-of-light, occupancy, launch, scheduler, warp-state and memory sections:
# OUT_DIR/profile-<model>-b<batch>-detail.txt (why a kernel takes its time, not only how long);
# ROLLOUTD_PROFILE_SECTIONS picks other sections (below).
set -uo pipefail
build=${1:?usage: profile-engine.sh BUILD_DIR OUT_DIR [MODEL [BATCHES [ARGS...]]]}
out=${2:?usage}
model=${3:-h2880}
batches=${4:-1,32,256}
shift $(( $# < 4 ? $# : 4 ))
here=$(cd "$(dirname "$0")/../.." && pwd)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 2; }
bin="$build/tests/bench/engine/engine_bench"
# The detail pass's sections; ROLLOUTD_PROFILE_SECTIONS (space-separated section names) replaces
# them, e.g. "SpeedOfLight SchedulerStats WarpStateStats MemoryWorkloadAnalysis PmSampling
# SourceCounters" for whether a kernel's DRAM and issue overlap or take turns over its run
# (tests/bench/NOTES.md, "The decode kernel at one token, analysed").
read -r -a names <<<"${ROLLOUTD_PROFILE_SECTIONS:-SpeedOfLight Occupancy LaunchStats SchedulerStats WarpStateStats MemoryWorkloadAnalysis}"
detail_sections=()
for n in "${names[@]}"; do detail_sections+=(--section "$n"); done
mkdir -p "$out"
for b in ${batches//,/ }; do
  f="$out/profile-$model-b$b"
  # --cache-control none: no L2 flush before each kernel (a decode step's small kernels find
  # their inputs in L2, as they do without the profiler). The CSV goes to --log-file.
  timeout "${ROLLOUTD_PROFILE_TIMEOUT:-240}" "$ncu" --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum \
    --launch-skip "${ROLLOUTD_PROFILE_SKIP:-3000}" --launch-count "${ROLLOUTD_PROFILE_COUNT:-600}" \
    --csv --page raw --log-file "$f.csv" \
    "$bin" --models "$model" --batches "$b" --new-tokens 32 --graphs off "$@" >/dev/null 2>"$f.err"
  echo "ncu rc=$? ($(wc -l <"$f.csv") csv lines)"; tail -3 "$f.err"; rm -f "$f.err"
  python3 "$here/tests/gpu/ncu_summary.py" "$f.csv" | tee "$f.txt"
  [ "${ROLLOUTD_PROFILE_KEEP_CSV:-0}" = 1 ] || rm -f "$f.csv"
  if [ -n "${ROLLOUTD_PROFILE_DETAIL:-}" ]; then
    timeout "${ROLLOUTD_PROFILE_TIMEOUT:-240}" "$ncu" --clock-control none --cache-control none \
      --kernel-name "regex:${ROLLOUTD_PROFILE_DETAIL}" --launch-skip "${ROLLOUTD_PROFILE_DETAIL_SKIP:-200}" \
      --launch-count "${ROLLOUTD_PROFILE_DETAIL_COUNT:-4}" \
      "${detail_sections[@]}" --page details --log-file "$f-detail.txt" \
      "$bin" --models "$model" --batches "$b" --new-tokens 32 --graphs off "$@" >/dev/null 2>"$f.err"
    echo "ncu detail rc=$? ($(grep -c "Section: GPU Speed Of Light" "$f-detail.txt" 2>/dev/null) kernels)"; tail -3 "$f.err"; rm -f "$f.err"
  fi
done
