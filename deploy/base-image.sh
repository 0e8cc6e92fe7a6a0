#!/usr/bin/env bash
# Build a Python 3.11 base image locally, for machines that cannot pull `python:3.11-slim`.
#
#   deploy/base-image.sh TAG [WORK_DIR]        e.g. deploy/base-image.sh dpfl-local/python:3.11
#
# Debian bookworm (minbase) with python3 (3.11), python3-venv and ca-certificates, made by
# debootstrap from the mirror apt already uses on this host, then `docker import`ed as TAG.
# Pass TAG to the dpfl image build as BASE_IMAGE (deploy/image.sh --base TAG). Needs root,
# debootstrap and a running Docker engine (DOCKER_HOST is honoured).
set -euo pipefail
tag=${1:?usage: deploy/base-image.sh TAG [WORK_DIR]}
work=${2:-$(mktemp -d)}
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
         | awk '$1=="URIs:"{print $2; exit} $1=="deb"{print ($2 ~ /^\[/ ? $3 : $2); exit}' || true)
[ -n "$mirror" ] || { echo "no apt mirror found in /etc/apt" >&2; exit 1; }
mkdir -p "$work"
rootfs=$work/rootfs
rm -rf "$rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
rm -rf "$rootfs"
echo "$tag"
