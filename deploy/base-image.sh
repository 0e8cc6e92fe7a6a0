#!/usr/bin/env bash
# Build a Python 3.11 base image locally, for machines that cannot pull `python:3.11-slim`.
#
#   deploy/base-image.sh TAG [WORK_DIR]        e.g. deploy/base-image.sh dpfl-local/python:3.11
#   deploy/base-image.sh --rootfs-only WORK_DIR        step 1 only (no Docker engine needed)
#   deploy/base-image.sh --from-rootfs WORK_DIR TAG    step 2 only, from step 1's WORK_DIR
#
# 1. Debian bookworm (minbase) with python3 (3.11), python3-venv and ca-certificates, made by
#    debootstrap from the mirror apt already uses on this host into WORK_DIR/rootfs (needs
#    root and debootstrap; it waits on the network most of its time).
# 2. That root filesystem `docker import`ed as TAG (needs a running Docker engine;
#    DOCKER_HOST is honoured), then removed.
# Pass TAG to the dpfl image build as BASE_IMAGE (deploy/image.sh --base TAG).
# Arguments, root, the tools and the engine are checked before anything is written (a problem
# is one line on stderr naming it, exit 2); a temporary WORK_DIR is removed afterwards.
set -euo pipefail
me=deploy/base-image.sh
. "$(dirname "$0")/lib.sh"  # die, require_engine


usage="usage: $me TAG [WORK_DIR] | --rootfs-only WORK_DIR | --from-rootfs WORK_DIR TAG   e.g. $me dpfl-local/python:3.11"
steps=all
case "${1:-}" in
  --rootfs-only) [ $# = 2 ] && [ -n "$2" ] || die 2 "$usage"; steps=rootfs; work=$2; tag= ;;
  --from-rootfs) [ $# = 3 ] && [ -n "$2" ] && [ -n "$3" ] || die 2 "$usage"; steps=import; work=$2; tag=$3 ;;
  *) [ $# -ge 1 ] && [ $# -le 2 ] && [ -n "$1" ] && [[ $1 != -* ]] || die 2 "$usage"
     tag=$1; work=${2:-} ;;
esac
if [ "$steps" != rootfs ]; then
  [[ $tag =~ ^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_.-]+)?$ ]] \
    || die 2 "TAG '$tag': not an image name (lowercase name[:tag], e.g. dpfl-local/python:3.11)"
fi
[ "$(id -u)" = 0 ] || die 2 "needs root: debootstrap builds the root filesystem (chroot, device nodes); run it with sudo"
if [ -n "$work" ] && [ -e "$work" ] && [ ! -d "$work" ]; then die 2 "WORK_DIR '$work' exists and is not a directory"; fi
if [ "$steps" = import ]; then
  [ -x "$work/rootfs/usr/bin/python3" ] \
    || die 2 "--from-rootfs: '$work/rootfs' holds no root filesystem with python3 (make it with $me --rootfs-only $work)"
else
  command -v debootstrap > /dev/null || die 2 "'debootstrap' not found on PATH (apt-get install debootstrap)"
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
           | awk '$1=="URIs:"{print $2; exit} $1=="deb"{print ($2 ~ /^\[/ ? $3 : $2); exit}' || true)
  [ -n "$mirror" ] || die 2 "no apt mirror found in /etc/apt/sources.list{,.d/} (debootstrap needs one)"
fi
if [ "$steps" != rootfs ]; then
  command -v docker > /dev/null || die 2 "'docker' not found on PATH (apt-get install docker.io)"
  require_engine
fi

if [ -n "$work" ]; then
  mkdir -p "$work"
  [ "$steps" = rootfs ] || trap 'rm -rf "$work/rootfs"' EXIT
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
rootfs=$work/rootfs
if [ "$steps" != import ]; then
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
    || die 1 "debootstrap failed: $(grep -v '^[[:space:]]*$' "$work/debootstrap.log" | tail -1)"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  if [ "$steps" = rootfs ]; then
    echo "$rootfs"
    exit 0
  fi
fi
tar -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "$tag"
