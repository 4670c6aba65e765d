#!/usr/bin/env bash
# launch-node.sh: one rolloutd per GPU on this node (or per CPU slot where there is no GPU),
# supervised. Writes the daemons' endpoints to one JSON file a coordinator reads
# (rolloutd.Coordinator.from_file), forwards SIGTERM/SIGINT to every daemon and waits for
# their drains, restarts a daemon that crashes (exponential back-off), and gives up, stopping
# the others and exiting non-zero, when one crashes --max-crashes times in a row.
#
#   deploy/launch-node.sh --bind 0.0.0.0 --advertise "$(hostname -f)" -- --drain-timeout-s 60 \
#       --curve-key-file /etc/rolloutd/daemon.key_secret --curve-allow /etc/rolloutd/clients
#
# Options (each has an environment twin; the flag wins):
#   --num-daemons N      ROLLOUTD_NUM_DAEMONS  default: the GPUs CUDA_VISIBLE_DEVICES names, else
#                                              nvidia-smi -L's GPUs, else ROLLOUTD_CPU_SLOTS (1)
#   --device D           ROLLOUTD_DEVICE       cpu | cuda | auto; default cuda when GPUs were found
#   --bind ADDR          ROLLOUTD_BIND         both sockets of every daemon (default 127.0.0.1). A
#                                              daemon binds another address only with CURVE keys
#                                              (ROLLOUTD_CURVE_KEY_FILE + ROLLOUTD_CURVE_ALLOW, or the
#                                              flags after --) or --insecure-bind-any; else it exits
#                                              64 and so does this script (README "Securing the
#                                              control plane")
#   --advertise HOST     ROLLOUTD_ADVERTISE    host written to the endpoints file when ADDR is
#                                              0.0.0.0 (default: hostname -f)
#   --control-port BASE  ROLLOUTD_CONTROL_PORT daemon i listens on BASE+i (default 7600; 0: ephemeral)
#   --http-port BASE     ROLLOUTD_HTTP_PORT    daemon i serves HTTP on BASE+i (default 7700; 0: ephemeral)
#   --run-dir DIR        ROLLOUTD_RUN_DIR      per-daemon endpoint files (default: a new /tmp dir)
#   --endpoints-file F   ROLLOUTD_NODE_FILE    the node's endpoints (default DIR/endpoints.json)
#   --log-dir DIR        ROLLOUTD_LOG_DIR      daemon-<i>.log per daemon (default: this stdout)
#   --max-crashes N      ROLLOUTD_MAX_CRASHES  crashes in a row before giving up (default 3)
#   --backoff-s S        ROLLOUTD_BACKOFF_S    first restart delay, doubled per crash (default 1)
#   --backoff-max-s S    ROLLOUTD_BACKOFF_MAX_S  (default 30)
#   --stable-s S         ROLLOUTD_STABLE_S     a run this long resets the crash count (default 60)
#   --stop-timeout-s S   ROLLOUTD_STOP_TIMEOUT_S  after SIGTERM, SIGKILL daemons still running
#                                              after this long (default 90: drain 30 + flush 5 + margin)
#   -- ARGS              passed to every daemon
# ROLLOUTD_BIN names the daemon binary (default: next to this script, then PATH, then the build).
#
# Exit status: 0 when every daemon exited 0 (SIGTERM and drained, or a shutdown message);
# 1 when a daemon crashed --max-crashes times in a row, or did not exit 0 after SIGTERM;
# 64 on a usage error (ours, or a daemon's: retrying would not help).
set -uo pipefail

if (( BASH_VERSINFO[0] < 5 )); then
  echo "launch-node.sh: needs bash >= 5 (EPOCHREALTIME)" >&2
  exit 64
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# JSON lines like the daemon's (ts with milliseconds, level, subsys, msg, fields).
log() {
  local t=$EPOCHREALTIME ts
  printf -v ts '%(%Y-%m-%dT%H:%M:%S)T' "${t%[.,]*}"
  printf '{"ts":"%s.%sZ","level":"%s","subsys":"launcher","msg":"%s"%s}\n' "$ts" "${t:${#t}-6:3}" "$1" "$2" "${3:+,$3}"
}
die_usage() { echo "launch-node.sh: $*" >&2; exit 64; }

# ---- settings: flag, then environment, then default ----
num_daemons=${ROLLOUTD_NUM_DAEMONS:-}
device=${ROLLOUTD_DEVICE:-}
bind=${ROLLOUTD_BIND:-127.0.0.1}
advertise=${ROLLOUTD_ADVERTISE:-}
control_base=${ROLLOUTD_CONTROL_PORT:-7600}
http_base=${ROLLOUTD_HTTP_PORT:-7700}
run_dir=${ROLLOUTD_RUN_DIR:-}
node_file=${ROLLOUTD_NODE_FILE:-}
log_dir=${ROLLOUTD_LOG_DIR:-}
max_crashes=${ROLLOUTD_MAX_CRASHES:-3}
backoff_s=${ROLLOUTD_BACKOFF_S:-1}
backoff_max_s=${ROLLOUTD_BACKOFF_MAX_S:-30}
stable_s=${ROLLOUTD_STABLE_S:-60}
stop_timeout_s=${ROLLOUTD_STOP_TIMEOUT_S:-90}
extra=()
while (( $# )); do
  case $1 in
    --num-daemons) num_daemons=${2-}; shift 2 ;;
    --device) device=${2-}; shift 2 ;;
    --bind) bind=${2-}; shift 2 ;;
    --advertise) advertise=${2-}; shift 2 ;;
    --control-port) control_base=${2-}; shift 2 ;;
    --http-port) http_base=${2-}; shift 2 ;;
    --run-dir) run_dir=${2-}; shift 2 ;;
    --endpoints-file) node_file=${2-}; shift 2 ;;
    --log-dir) log_dir=${2-}; shift 2 ;;
    --max-crashes) max_crashes=${2-}; shift 2 ;;
    --backoff-s) backoff_s=${2-}; shift 2 ;;
    --backoff-max-s) backoff_max_s=${2-}; shift 2 ;;
    --stable-s) stable_s=${2-}; shift 2 ;;
    --stop-timeout-s) stop_timeout_s=${2-}; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die_usage "unknown option '$1' (daemon flags go after --)" ;;
  esac
done

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
is_seconds() { [[ $1 =~ ^[0-9]+(\.[0-9]+)?$ ]]; }
# Seconds ("1.5") to integer milliseconds, without a subprocess.
to_ms() {
  local int=${1%%.*} frac=000
  [[ $1 == *.* ]] && frac=${1#*.}000
  echo $(( 10#$int * 1000 + 10#${frac:0:3} ))
}
# Milliseconds since the epoch, into $now (no fork: called every tick).
tick_now() { local t=${EPOCHREALTIME/[.,]/}; now=$(( t / 1000 )); }

# Devices CUDA_VISIBLE_DEVICES names, counted as CUDA does (it stops at the first invalid one).
count_visible() {
  local n=0 item
  IFS=, read -r -a items <<<"$1"
  for item in "${items[@]}"; do
    item=${item//[[:space:]]/}
    [[ -z $item || $item == -* || $item == NoDevFiles ]] && break
    n=$(( n + 1 ))
  done
  echo "$n"
}
count_gpus() {
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then count_visible "$CUDA_VISIBLE_DEVICES"; return; fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
    return
  fi
  echo 0
}

gpus=$(count_gpus)
if [[ -z $device ]]; then
  if (( gpus > 0 )); then device=cuda; else device=cpu; fi
fi
[[ $device == cpu || $device == cuda || $device == auto ]] || die_usage "--device must be cpu, cuda or auto"
if [[ -z $num_daemons ]]; then
  if [[ $device != cpu ]] && (( gpus > 0 )); then num_daemons=$gpus; else num_daemons=${ROLLOUTD_CPU_SLOTS:-1}; fi
fi
is_uint "$num_daemons" && (( num_daemons >= 1 && num_daemons <= 1024 )) || die_usage "--num-daemons must be 1..1024"
is_uint "$control_base" && is_uint "$http_base" || die_usage "ports must be integers"
for v in max_crashes; do is_uint "${!v}" && (( ${!v} >= 1 )) || die_usage "--max-crashes must be >= 1"; done
for v in backoff_s backoff_max_s stable_s stop_timeout_s; do is_seconds "${!v}" || die_usage "--${v//_/-} must be seconds"; done
if (( control_base != 0 && control_base + num_daemons > 65536 )) || (( http_base != 0 && http_base + num_daemons > 65536 )); then
  die_usage "port base + number of daemons is past 65535"
fi
if (( control_base != 0 && http_base != 0 )) && (( control_base < http_base + num_daemons && http_base < control_base + num_daemons )); then
  die_usage "the control ports [$control_base, +$num_daemons) and HTTP ports [$http_base, +$num_daemons) overlap"
fi
if [[ -z $advertise ]]; then advertise=$(hostname -f 2>/dev/null || hostname); fi

bin=${ROLLOUTD_BIN:-}
if [[ -z $bin ]]; then
  for c in "$here/rolloutd" "$here/../bin/rolloutd" "$(command -v rolloutd 2>/dev/null)" "$here/../build/ci/daemon/rolloutd"; do
    if [[ -n $c && -x $c ]]; then bin=$c; break; fi
  done
fi
[[ -n $bin && -x $bin ]] || die_usage "no rolloutd binary (set ROLLOUTD_BIN)"

if [[ -z $run_dir ]]; then run_dir=$(mktemp -d /tmp/rolloutd-node.XXXXXX); fi
mkdir -p "$run_dir" || die_usage "cannot create $run_dir"
[[ -n $node_file ]] || node_file=$run_dir/endpoints.json
[[ -z $log_dir ]] || mkdir -p "$log_dir" || die_usage "cannot create $log_dir"

backoff_ms=$(to_ms "$backoff_s"); backoff_max_ms=$(to_ms "$backoff_max_s")
stable_ms=$(to_ms "$stable_s"); stop_timeout_ms=$(to_ms "$stop_timeout_s")

# ---- per-daemon state ----
# state: starting (launched, no endpoints yet) | running | backoff (crashed, restart due at
# restart_at) | exited (exit 0 on its own: a shutdown message) | failed (gave up) | stopped
declare -a pid state crashes restarts started restart_at control http dpid dgpu
for (( i = 0; i < num_daemons; i++ )); do
  pid[i]=0; state[i]=starting; crashes[i]=0; restarts[i]=0; started[i]=0; restart_at[i]=0
  control[i]=""; http[i]=""; dpid[i]=0; dgpu[i]=-1
done

# JSON string of $1 into $J (no subshell: write_node_file runs on every state change).
jstr() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; J="\"$s\""; }
json_str() { jstr "$1"; printf '%s' "$J"; }
# The daemon writes "tcp://0.0.0.0:port" when bound to every interface: name this host instead.
advertised() { local u=$1 any; for any in 0.0.0.0 '*' '[::]'; do u=${u/"//$any:"/"//$advertise:"}; done; A=$u; }

write_node_file() {
  local out i sep=""
  jstr "$advertise"; out="{\"host\":$J,\"launcher_pid\":$$,\"device\":\"$device\",\"daemons\":["
  for (( i = 0; i < num_daemons; i++ )); do
    out+="$sep{\"index\":$i,\"state\":\"${state[i]}\",\"restarts\":${restarts[i]},\"pid\":${dpid[i]},\"gpu\":${dgpu[i]}"
    if [[ -n ${control[i]} ]]; then
      jstr "${control[i]}"; out+=",\"control\":$J"
      jstr "${http[i]}"; out+=",\"http\":$J"
    fi
    out+="}"
    sep=","
  done
  out+="]}"
  printf '%s\n' "$out" >"$node_file.tmp.$$" && mv -f "$node_file.tmp.$$" "$node_file"
}

start_daemon() {
  local i=$1
  rm -f "$run_dir/daemon-$i.json"
  # ROLLOUTD_GPU / ROLLOUTD_ENDPOINTS_FILE / ROLLOUTD_LOCAL_INDEX in our environment would give
  # every daemon the same GPU or file: the flags below decide those per daemon.
  local cmd=(env -u ROLLOUTD_GPU -u ROLLOUTD_ENDPOINTS_FILE -u ROLLOUTD_LOCAL_INDEX
    "$bin" --device "$device" --local-index "$i" --bind "$bind" --http-bind "$bind"
    --control-port "$control_base" --http-port "$http_base"
    --endpoints-file "$run_dir/daemon-$i.json" "${extra[@]}")
  if [[ -n $log_dir ]]; then
    "${cmd[@]}" >>"$log_dir/daemon-$i.log" 2>&1 &
  else
    "${cmd[@]}" &  # JSON lines on our stdout, for journald / Slurm / kubectl logs
  fi
  pid[i]=$!
  tick_now
  started[i]=$now
  state[i]=starting
  dpid[i]=${pid[i]}
  log info "daemon started" "\"index\":$i,\"pid\":${pid[i]},\"restarts\":${restarts[i]}"
  write_node_file
}

# Picks up a daemon's endpoints once it has written them (it does so once listening).
poll_endpoints() {
  local i=$1 f=$run_dir/daemon-$1.json j
  [[ -s $f ]] || return 0
  j=$(<"$f")
  [[ $j =~ \"control\":\"([^\"]*)\" ]] && advertised "${BASH_REMATCH[1]}" && control[i]=$A
  [[ $j =~ \"http\":\"([^\"]*)\" ]] && advertised "${BASH_REMATCH[1]}" && http[i]=$A
  [[ $j =~ \"gpu\":(-?[0-9]+) ]] && dgpu[i]=${BASH_REMATCH[1]}
  state[i]=running
  log info "daemon listening" "\"index\":$i,\"pid\":${pid[i]},\"control\":$(json_str "${control[i]}"),\"http\":$(json_str "${http[i]}")"
  write_node_file
}

stop_requested=0
signals=0
on_signal() { stop_requested=1; signals=$(( signals + 1 )); }
trap on_signal TERM INT
trap '' PIPE

# One fifo read is the loop's sleep: no process per tick, and signals still run their trap.
mkfifo "$run_dir/.tick.$$" && exec {tick}<>"$run_dir/.tick.$$" && rm -f "$run_dir/.tick.$$"
nap() { read -r -t "$1" -u "$tick" _ || true; }

stop_all() {  # SIGTERM every daemon (again on every further signal), wait for drains, SIGKILL late ones
  local reason=$1 i alive forwarded=-1 deadline
  tick_now; deadline=$(( now + stop_timeout_ms ))
  log info "stopping daemons" "\"reason\":\"$reason\""
  for (( i = 0; i < num_daemons; i++ )); do [[ ${state[i]} == backoff ]] && state[i]=stopped; done
  while :; do
    if (( signals != forwarded )); then  # a second SIGTERM shortens the daemons' drains too
      forwarded=$signals
      for (( i = 0; i < num_daemons; i++ )); do
        [[ ${state[i]} == starting || ${state[i]} == running ]] && kill -TERM "${pid[i]}" 2>/dev/null
      done
    fi
    alive=0
    for (( i = 0; i < num_daemons; i++ )); do
      [[ ${state[i]} == starting || ${state[i]} == running ]] || continue
      if kill -0 "${pid[i]}" 2>/dev/null; then alive=1; continue; fi
      wait "${pid[i]}"; rcs[i]=$?
      state[i]=stopped
      log info "daemon exited" "\"index\":$i,\"pid\":${pid[i]},\"exit_code\":${rcs[i]}"
    done
    (( alive )) || break
    tick_now
    if (( now >= deadline )); then
      for (( i = 0; i < num_daemons; i++ )); do
        if [[ ${state[i]} == starting || ${state[i]} == running ]]; then
          log error "daemon did not stop in time; SIGKILL" "\"index\":$i,\"pid\":${pid[i]}"
          kill -KILL "${pid[i]}" 2>/dev/null; wait "${pid[i]}" 2>/dev/null; rcs[i]=137; state[i]=stopped
        fi
      done
      break
    fi
    nap 0.1
  done
  write_node_file
}

declare -a rcs
for (( i = 0; i < num_daemons; i++ )); do rcs[i]=-1; done
log info "launching" "\"daemons\":$num_daemons,\"device\":\"$device\",\"bin\":$(json_str "$bin"),\"endpoints_file\":$(json_str "$node_file")"
write_node_file
for (( i = 0; i < num_daemons; i++ )); do start_daemon "$i"; done

exit_code=0
give_up=""
while :; do
  if (( stop_requested )); then stop_all signal; break; fi
  tick_now
  active=0
  for (( i = 0; i < num_daemons; i++ )); do
    case ${state[i]} in
      starting|running)
        active=1
        if kill -0 "${pid[i]}" 2>/dev/null; then
          [[ ${state[i]} == starting ]] && poll_endpoints "$i"
          continue
        fi
        wait "${pid[i]}"; rc=$?
        ran_ms=$(( now - started[i] ))
        if (( rc == 0 )); then
          state[i]=exited
          log info "daemon exited 0 on its own (shutdown message); not restarting" "\"index\":$i,\"pid\":${pid[i]}"
        elif (( rc == 64 )); then
          state[i]=failed
          give_up="daemon $i: usage error (exit 64)"; exit_code=64
        else
          if (( ran_ms >= stable_ms )); then crashes[i]=1; else crashes[i]=$(( crashes[i] + 1 )); fi
          if (( crashes[i] >= max_crashes )); then
            state[i]=failed
            give_up="daemon $i crashed ${crashes[i]} times in a row (last exit $rc)"; exit_code=1
            log error "daemon crashed; giving up" "\"index\":$i,\"exit_code\":$rc,\"crashes\":${crashes[i]}"
          else
            delay=$(( backoff_ms << (crashes[i] - 1) ))
            (( delay > backoff_max_ms )) && delay=$backoff_max_ms
            state[i]=backoff; restart_at[i]=$(( now + delay ))
            log warn "daemon crashed; restarting after back-off" "\"index\":$i,\"exit_code\":$rc,\"crashes\":${crashes[i]},\"ran_s\":$(( ran_ms / 1000 )),\"backoff_s\":$(( delay / 1000 )).$(printf %03d $(( delay % 1000 )))"
          fi
        fi
        write_node_file
        ;;
      backoff)
        active=1
        if (( now >= restart_at[i] )); then restarts[i]=$(( restarts[i] + 1 )); start_daemon "$i"; fi
        ;;
    esac
  done
  if [[ -n $give_up ]]; then
    log error "giving up: stopping the other daemons" "\"why\":$(json_str "$give_up")"
    stop_all give_up
    break
  fi
  (( active )) || break  # every daemon exited 0 on its own
  nap 0.2
done

if (( exit_code == 0 )); then
  for (( i = 0; i < num_daemons; i++ )); do
    if [[ ${rcs[i]} != -1 && ${rcs[i]} != 0 ]]; then exit_code=1; fi
  done
fi
log info "launcher exiting" "\"exit_code\":$exit_code"
exit "$exit_code"
