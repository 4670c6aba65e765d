#!/bin/bash
# One Slurm task = one rolloutd on the task's GPU (deploy/slurm/rolloutd.sbatch runs it).
# Binds to the node's address so other nodes' coordinators can reach it; writes its
# endpoints to $ROLLOUTD_RUN_DIR/<node>-<localid>.json. Arguments after -- go to the daemon.
# A non-loopback address needs CURVE keys: ROLLOUTD_CURVE_KEY_FILE and ROLLOUTD_CURVE_ALLOW
# (rolloutd.sbatch exports them) reach the daemon through the environment.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${ROLLOUTD_BIN:-$here/rolloutd}
[[ ${1:-} == -- ]] && shift
addr=${ROLLOUTD_BIND:-$(hostname -I | awk '{print $1}')}
node=$(hostname -s)
# --device cuda, no --gpu: the daemon takes ordinal 0 when CUDA_VISIBLE_DEVICES names one
# device (--gpus-per-task=1), else SLURM_LOCALID; its ports are 7600/7700 + SLURM_LOCALID.
exec "$bin" --device cuda --bind "$addr" --http-bind "$addr" \
  --endpoints-file "${ROLLOUTD_RUN_DIR:?}/$node-${SLURM_LOCALID:?}.json" "$@"
