#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts two rolloutd daemons on the
# embedded default model, runs a small coordinator against both, and stops the
# daemons cleanly with SIGTERM (each drains and exits 0).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
deploy/install-deps.sh
if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
preset=${ROLLOUTD_PRESET:-ci}
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "${ROLLOUTD_JOBS:-$(nproc)}" --target rolloutd rolloutctl _native

build=build/$preset
run=$(mktemp -d /tmp/rolloutd-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

endpoints=()
for i in 0 1; do
  "$build/daemon/rolloutd" --control-port 0 --http-port 0 --endpoints-file "$run/d$i.json" \
      >"$run/d$i.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 1 100); do [ -s "$run/d$i.json" ] && break; sleep 0.1; done
  [ -s "$run/d$i.json" ] || { echo "daemon $i did not start; log:"; cat "$run/d$i.log"; exit 1; }
  ep=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["control"])' "$run/d$i.json")
  http=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$run/d$i.json")
  echo "daemon $i: control $ep, health $http/readyz"
  endpoints+=("$ep")
done

PYTHONPATH="$build/python" /usr/bin/python3 deploy/demo/coordinator.py "${endpoints[@]}"

echo
echo "stopping the daemons (SIGTERM: drain, then exit 0)"
status=0
for i in 0 1; do
  kill -TERM "${pids[$i]}"
  if wait "${pids[$i]}"; then echo "daemon $i exited 0"; else rc=$?; echo "daemon $i exited $rc"; status=1; fi
done
pids=()
echo "logs: $run"
exit $status
