#!/usr/bin/env bash
# Build the dpfl image (one image, every Flower role).
#
#   deploy/image.sh [--tag dpfl:0.1.0] [--base python:3.11-slim] [--torch "torch==2.13.0"]
#                   [--wheels-only | --from-wheelhouse]
#
# 1. deploy/wheelhouse/: dpfl's own wheel and every dependency as wheels, made by this
#    host's pip (CPU torch; flwr, opacus and the rest at constraints.txt's pins; torchvision
#    and Ray are left out: the image does not simulate and the MNIST default needs neither).
#    Point pip at a CPU-only torch index with PIP_EXTRA_INDEX_URL if plain PyPI would hand
#    you a CUDA build. --wheels-only stops here (no Docker engine needed): make the
#    wheelhouse on a host that reaches a package index, build on one that does not.
# 2. `docker build --network none` of deploy/Dockerfile FROM --base: the build reads only the
#    wheelhouse, so it works where no registry is reachable (with a local base, see
#    deploy/base-image.sh). DOCKER_HOST is honoured. --from-wheelhouse skips step 1 and
#    builds from the wheelhouse already there (it must hold dpfl's and torch's wheels).
# Arguments, tools (docker, Python with pip), the engine and the base image are checked before
# anything is written: a problem is one line on stderr naming it, exit 2.
set -euo pipefail
me=deploy/image.sh
. "$(dirname "$0")/lib.sh"  # die, require_engine
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=dpfl:0.1.0 base=python:3.11-slim torch_spec="torch==2.13.0" steps=all
python=${PYTHON:-python3}


while [ $# -gt 0 ]; do
  case "$1" in
    --tag|--base|--torch) [ $# -ge 2 ] && [ -n "$2" ] || die 2 "$1 needs a value" ;;
  esac
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --torch) torch_spec=$2; shift 2 ;;
    --wheels-only|--from-wheelhouse)
      [ "$steps" = all ] || die 2 "--wheels-only and --from-wheelhouse exclude each other"
      steps=${1#--}; shift ;;
    *) die 2 "unknown argument '$1' (usage: $me [--tag T] [--base IMAGE] [--torch SPEC] [--wheels-only | --from-wheelhouse])" ;;
  esac
done
[[ $tag =~ ^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_.-]+)?$ ]] \
  || die 2 "--tag '$tag': not an image name (lowercase name[:tag], e.g. dpfl:0.1.0)"
wheels=$repo/deploy/wheelhouse
has_wheels() { ls "$wheels"/dpfl-*.whl "$wheels"/torch-*.whl > /dev/null 2>&1; }
if [ "$steps" != wheels-only ]; then
  command -v docker > /dev/null || die 2 "'docker' not found on PATH (apt-get install docker.io)"
fi
if [ "$steps" != from-wheelhouse ]; then
  command -v "$python" > /dev/null || die 2 "PYTHON '$python' not found (set PYTHON to a Python 3.11-3.12 with pip)"
  "$python" -m pip --version > /dev/null 2>&1 || die 2 "PYTHON '$python' has no pip (set PYTHON to one that has)"
else
  has_wheels && [ -f "$wheels/constraints.txt" ] \
    || die 2 "--from-wheelhouse: $wheels holds no dpfl or torch wheel or no constraints.txt (make it with $me --wheels-only)"
fi
if [ "$steps" != wheels-only ]; then
  require_engine
  docker image inspect "$base" > /dev/null 2>&1 \
    || die 2 "base image '$base' is not in the Docker engine at $engine (the build has no network): docker pull $base, or deploy/base-image.sh dpfl-local/python:3.11 and --base dpfl-local/python:3.11"
fi

logs=$(mktemp -d "${TMPDIR:-/tmp}/dpfl-image.XXXXXX")  # kept when a step fails
if [ "$steps" != from-wheelhouse ]; then
  mkdir -p "$wheels"
  rm -f "$wheels"/dpfl-*.whl
  # The image's pins: constraints.txt without the host's CUDA torch stack.
  grep -v -E '^(torch|torchvision|triton|nvidia-|cuda-)' "$repo/constraints.txt" > "$wheels/constraints.txt"
  "$python" -m pip wheel -q --disable-pip-version-check -w "$wheels" -c "$wheels/constraints.txt" \
    "$repo[mnist]" "$torch_spec" > "$logs/pip-wheel.log" 2>&1 \
    || die 1 "pip wheel failed: $(grep -v 'is ignored: it is neither' "$logs/pip-wheel.log" | grep -v '^[[:space:]]*$' | tail -1) (log: $logs/pip-wheel.log)"
  has_wheels || die 1 "pip wheel made no dpfl or torch wheel in $wheels (log: $logs/pip-wheel.log)"
  if [ "$steps" = wheels-only ]; then
    rm -rf "$logs"
    echo "$wheels"
    exit 0
  fi
fi
DOCKER_BUILDKIT=0 docker build -q --network none --build-arg "BASE_IMAGE=$base" -t "$tag" \
  -f "$repo/deploy/Dockerfile" "$repo" > "$logs/docker-build.log" 2>&1 \
  || die 1 "docker build failed: $(grep -v '^[[:space:]]*$' "$logs/docker-build.log" | tail -1) (log: $logs/docker-build.log)"
rm -rf "$logs"
echo "$tag"
