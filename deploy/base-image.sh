#!/usr/bin/env bash
# Build a Python 3.11 base image locally, for machines that cannot pull `python:3.11-slim`.
#
#   deploy/base-image.sh TAG [WORK_DIR]        e.g. deploy/base-image.sh dpfl-local/python:3.11
#
# Debian bookworm (minbase) with python3 (3.11), python3-venv and ca-certificates, made by
# debootstrap from the mirror apt already uses on this host, then `docker import`ed as TAG.
# Pass TAG to the dpfl image build as BASE_IMAGE (deploy/image.sh --base TAG). Needs root,
# debootstrap and a running Docker engine (DOCKER_HOST is honoured).
# Arguments, root, the tools and the engine are checked before anything is written (a problem
# is one line on stderr naming it, exit 2); a temporary WORK_DIR is removed afterwards.
set -euo pipefail
me=deploy/base-image.sh
. "$(dirname "$0")/lib.sh"  # die, require_engine


[ $# -ge 1 ] && [ $# -le 2 ] && [ -n "$1" ] && [[ $1 != -* ]] \
  || die 2 "usage: $me TAG [WORK_DIR]   e.g. $me dpfl-local/python:3.11"
tag=$1
[[ $tag =~ ^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_.-]+)?$ ]] \
  || die 2 "TAG '$tag': not an image name (lowercase name[:tag], e.g. dpfl-local/python:3.11)"
[ "$(id -u)" = 0 ] || die 2 "needs root: debootstrap builds the root filesystem (chroot, device nodes); run it with sudo"
command -v debootstrap > /dev/null || die 2 "'debootstrap' not found on PATH (apt-get install debootstrap)"
command -v docker > /dev/null || die 2 "'docker' not found on PATH (apt-get install docker.io)"
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
         | awk '$1=="URIs:"{print $2; exit} $1=="deb"{print ($2 ~ /^\[/ ? $3 : $2); exit}' || true)
[ -n "$mirror" ] || die 2 "no apt mirror found in /etc/apt/sources.list{,.d/} (debootstrap needs one)"
if [ $# = 2 ] && [ -e "$2" ] && [ ! -d "$2" ]; then die 2 "WORK_DIR '$2' exists and is not a directory"; fi
require_engine

if [ $# = 2 ]; then
  work=$2
  mkdir -p "$work"
  trap 'rm -rf "$work/rootfs"' EXIT
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
rootfs=$work/rootfs
rm -rf "$rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
  || die 1 "debootstrap failed: $(grep -v '^[[:space:]]*$' "$work/debootstrap.log" | tail -1)"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "$tag"
