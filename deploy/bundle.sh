#!/usr/bin/env bash
# bundle.sh: an offline tarball of rolloutd for x86-64 Linux nodes without package access.
# It holds the daemon, rolloutctl, the Python package (with its native module), the
# launchers and unit files, and every shared library they load except the C library
# (glibc) and what must match the node and the trainer: the CUDA driver (libcuda,
# libnvidia-*) and NCCL.
#
#   deploy/bundle.sh [--build-dir build/ci] [--out rolloutd-<version>-linux-x86_64.tar.gz]
#                    [--compress gz|zst|none]
#   # on the node:
#   tar -xf rolloutd-*.tar.gz && cd rolloutd-*/ && bin/rolloutd --device cuda --gpu 0
#   source env.sh   # PATH, PYTHONPATH and LD_LIBRARY_PATH for rolloutctl and `import rolloutd`
#
# The wrappers in bin/ put the bundle's lib/ first on the library path and check the node's
# glibc against the newest symbol version the bundle needs (MANIFEST.txt records both).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

build_dir=${ROLLOUTD_BUILD_DIR:-$root/build/ci}
out=""
compress=gz
daemon_bin="" ctl_bin="" py_dir=""
while (( $# )); do
  case $1 in
    --build-dir) build_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --compress) compress=$2; shift 2 ;;
    --rolloutd) daemon_bin=$2; shift 2 ;;
    --rolloutctl) ctl_bin=$2; shift 2 ;;
    --python-dir) py_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bundle.sh: unknown option '$1'" >&2; exit 64 ;;
  esac
done
daemon_bin=${daemon_bin:-$build_dir/daemon/rolloutd}
ctl_bin=${ctl_bin:-$build_dir/daemon/rolloutctl/rolloutctl}
py_dir=${py_dir:-$build_dir/python/rolloutd}
for f in "$daemon_bin" "$ctl_bin"; do
  [[ -x $f ]] || { echo "bundle.sh: $f is not built (cmake --build <dir> --target rolloutd rolloutctl _native)" >&2; exit 1; }
done
compgen -G "$py_dir/_native*.so" >/dev/null || { echo "bundle.sh: no native module in $py_dir" >&2; exit 1; }
case $compress in
  gz) ext=tar.gz; tar_flag=-z ;;
  zst) ext=tar.zst; tar_flag=--zstd; command -v zstd >/dev/null || { echo "bundle.sh: zstd is not installed" >&2; exit 1; } ;;
  none) ext=tar; tar_flag= ;;
  *) echo "bundle.sh: --compress must be gz, zst or none" >&2; exit 64 ;;
esac
[[ $(uname -m) == x86_64 ]] || echo "bundle.sh: warning: building on $(uname -m), not x86_64" >&2

version=$("$daemon_bin" --version 2>/dev/null | tail -n1 | tr -cd 'A-Za-z0-9._+-')
name=rolloutd-${version:-unknown}-linux-x86_64
out=${out:-$PWD/$name.$ext}
stage=$(mktemp -d "${TMPDIR:-/tmp}/rolloutd-bundle.XXXXXX")
trap 'rm -rf "$stage"' EXIT
b=$stage/$name
mkdir -p "$b"/{bin,libexec,lib,python,deploy}

# Libraries that stay the node's: glibc (its loader must match libc), the vDSO, the CUDA
# driver and NCCL (both must match the node and the trainer).
is_system_lib() {
  case $1 in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|libdl.so.*|librt.so.*|\
    libresolv.so.*|libutil.so.*|libanl.so.*|libnsl.so.*|libBrokenLocale.so.*|libcrypt.so.*) return 0 ;;
    libcuda.so.*|libnvidia-*.so*|libnccl.so*|libcudadebugger.so.*) return 0 ;;
  esac
  return 1
}

# A hard link where the stage shares a file system with the source (no copy of half a GB
# of cuBLAS), else a copy; symlinks are resolved either way.
place() { ln "$(readlink -f "$1")" "$2" 2>/dev/null || cp -L "$1" "$2"; }

declare -A origin
collect_libs() {  # every non-system library $1 loads (ldd lists the whole closure)
  local line soname path
  while IFS= read -r line; do
    if [[ $line =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+not\ found ]]; then
      soname=${BASH_REMATCH[1]}
      is_system_lib "$soname" && continue
      echo "bundle.sh: $1 needs $soname, which is not found here" >&2; exit 1
    fi
    [[ $line =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+([^[:space:]]+) ]] || continue
    soname=${BASH_REMATCH[1]} path=${BASH_REMATCH[2]}
    is_system_lib "$soname" && continue
    [[ -n ${origin[$soname]:-} ]] && continue
    origin[$soname]=$path
    place "$path" "$b/lib/$soname"
  done < <(ldd "$1")
}

place "$daemon_bin" "$b/libexec/rolloutd"
place "$ctl_bin" "$b/libexec/rolloutctl"
collect_libs "$daemon_bin"
collect_libs "$ctl_bin"
mkdir -p "$b/python/rolloutd"
cp -L "$py_dir"/*.py "$py_dir"/_native*.so "$b/python/rolloutd/"
for so in "$py_dir"/_native*.so; do collect_libs "$so"; done

# The newest glibc symbol version anything in the bundle needs.
glibc_needed=$(for f in "$b"/libexec/* "$b"/lib/* "$b"/python/rolloutd/*.so; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n -k3,3n -u | tail -n1)
glibc_needed=${glibc_needed:-2.17}

for tool in rolloutd rolloutctl; do
  cat >"$b/bin/$tool" <<EOF
#!/bin/sh
# $tool from the rolloutd offline bundle: the bundle's libraries first.
here=\$(dirname "\$(dirname "\$(readlink -f "\$0")")")
need=$glibc_needed
have=\$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print \$2}')
if [ -n "\$have" ] && [ "\$(printf '%s\n%s\n' "\$need" "\$have" | sort -t. -k1,1n -k2,2n | head -n1)" != "\$need" ]; then
  echo "$tool: this bundle needs glibc >= \$need; this node has \$have" >&2
  exit 2
fi
LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/libexec/$tool" "\$@"
EOF
  chmod 0755 "$b/bin/$tool"
done
cp "$root/deploy/launch-node.sh" "$root/deploy/slurm/srun-task.sh" "$b/bin/"
cp -r "$root/deploy/systemd" "$root/deploy/k8s" "$root/deploy/slurm" "$b/deploy/"
cp "$root/README.md" "$b/README.md"
cat >"$b/env.sh" <<'EOF'
# source this: the bundle's tools on PATH, its Python package on PYTHONPATH, and its libraries
# on LD_LIBRARY_PATH (the Python native module needs them; set before python starts).
_rd=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
export PATH="$_rd/bin${PATH:+:$PATH}"
export PYTHONPATH="$_rd/python${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$_rd/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _rd
EOF

# _native.cpython-311-x86_64-linux-gnu.so -> 3.11
py_abi=$(basename "$(ls "$b"/python/rolloutd/_native*.so | head -n1)" | sed -n 's/^_native\.cpython-\([0-9]\)\([0-9]*\).*/\1.\2/p')
{
  echo "rolloutd offline bundle $name"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME") ($(uname -m))"
  echo "needs: x86-64 Linux, glibc >= $glibc_needed; a CUDA driver (libcuda) for --device cuda; NCCL matching the trainer for nccl transfers; python ${py_abi:-3} for the Python package"
  echo
  echo "bundled libraries (soname <- origin):"
  for s in $(printf '%s\n' "${!origin[@]}" | sort); do echo "  $s <- ${origin[$s]}"; done
  echo
  echo "files:"
  (cd "$b" && find . -type f -printf '  %P %s\n' | sort)
} >"$b/MANIFEST.txt"

mkdir -p "$(dirname "$out")"
tar -C "$stage" $tar_flag -cf "$out.tmp.$$" "$name"
mv -f "$out.tmp.$$" "$out"
echo "$out"
