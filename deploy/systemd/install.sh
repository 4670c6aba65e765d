#!/usr/bin/env bash
# Installs the units and enables one instance per GPU (or N given): run as root.
#   deploy/systemd/install.sh [N]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
n=${1:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)}
[[ $n =~ ^[0-9]+$ ]] && (( n >= 1 )) || { echo "usage: $0 NUM_GPUS (no GPU found)" >&2; exit 64; }
install -m 0644 "$here/rolloutd@.service" "$here/rolloutd.target" /etc/systemd/system/
install -d /etc/rolloutd
systemctl daemon-reload
systemctl enable rolloutd.target
for (( i = 0; i < n; i++ )); do systemctl enable "rolloutd@$i.service"; done
echo "enabled rolloutd@0..$((n - 1)); start them with: systemctl start rolloutd.target"
