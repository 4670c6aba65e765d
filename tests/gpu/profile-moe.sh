#!/usr/bin/env bash
# Where one MoE layer's time goes at a few tokens (moe_bench --only CASE): Nsight Compute kernel
# durations (serialized, clocks left alone, no cache flush), then, where Nsight Systems is
# installed, the timeline of the CUDA-graph replays (kernel nodes traced one by one): each
# kernel's duration and the gap before it, as a replay runs them (PDL overlap included).
# Not part of run.sh's benches: run it by hand on the GPU host.
#   profile-moe.sh BUILD_DIR OUT_DIR [CASE...]   e.g. profile-moe.sh build/gpu $OUT gpt-oss-120b:1:bf16
# Writes OUT_DIR/profile-moe-<case>.txt. Plain python3 for the summaries (no packages).
set -uo pipefail
build=${1:?usage: profile-moe.sh BUILD_DIR OUT_DIR [CASE...]}
out=${2:?usage}
shift 2
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(gpt-oss-120b:1:bf16)
here=$(cd "$(dirname "$0")/../.." && pwd)
bin="$build/tests/bench/moe/moe_bench"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
mkdir -p "$out"
for c in "${cases[@]}"; do
  tok=${c#*:}; tok=${tok%%:*}
  f="$out/profile-moe-${c//:/-}"
  : >"$f.txt"
  if [ -n "$ncu" ]; then
    # Past the warm-up (3 forwards) into the timed eager forwards.
    timeout "${ROLLOUTD_PROFILE_TIMEOUT:-180}" "$ncu" --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --launch-skip 40 --launch-count 80 --csv --page raw --log-file "$f.csv" \
      "$bin" /tmp/profile-moe.json --only "$c" --tokens "$tok" >/dev/null 2>"$f.err"
    echo "ncu rc=$? ($(wc -l <"$f.csv") csv lines)" | tee -a "$f.txt"; tail -3 "$f.err"; rm -f "$f.err"
    python3 "$here/tests/gpu/ncu_summary.py" "$f.csv" >>"$f.txt" 2>&1
    rm -f "$f.csv"
  else
    echo "ncu not found" | tee -a "$f.txt"
  fi
  if [ -n "$nsys" ]; then
    timeout "${ROLLOUTD_PROFILE_TIMEOUT:-180}" "$nsys" profile -t cuda --cuda-graph-trace=node --force-overwrite true \
      -o "$f" "$bin" /tmp/profile-moe.json --only "$c" --tokens "$tok" >/dev/null 2>"$f.err"
    echo "nsys rc=$?" | tee -a "$f.txt"; tail -3 "$f.err"
    "$nsys" stats -q -r cuda_gpu_trace -f csv -o "$f" "$f.nsys-rep" >/dev/null 2>>"$f.err"
    python3 "$here/tests/gpu/nsys_timeline.py" "$f"_cuda_gpu_trace.csv >>"$f.txt" 2>&1
    rm -f "$f.nsys-rep" "$f.sqlite" "$f"_cuda_gpu_trace.csv "$f.err"
  else
    echo "nsys not found" | tee -a "$f.txt"
  fi
  cat "$f.txt"
done
