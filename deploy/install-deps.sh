#!/usr/bin/env bash
# Installs every package rolloutd needs to build, test and run on Debian 12.
# Idempotent: runs apt-get (update first) only when something is missing.
# The CUDA toolkit and NCCL are not Debian packages: CI has them under
# /usr/local/cuda; the build uses them when nvcc is there and skips CUDA otherwise.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mapfile -t pkgs < <(sed 's/#.*//' "$here/packages-debian12.txt" | awk 'NF')

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
