#!/usr/bin/env bash
# Build the dpfl image (one image, every Flower role).
#
#   deploy/image.sh [--tag dpfl:0.1.0] [--base python:3.11-slim] [--torch "torch==2.13.0"]
#
# 1. deploy/wheelhouse/: dpfl's own wheel and every dependency as wheels, made by this
#    host's pip (CPU torch; flwr, opacus and the rest at constraints.txt's pins; torchvision
#    and Ray are left out: the image does not simulate and the MNIST default needs neither).
#    Point pip at a CPU-only torch index with PIP_EXTRA_INDEX_URL if plain PyPI would hand
#    you a CUDA build.
# 2. `docker build --network none` of deploy/Dockerfile FROM --base: the build reads only the
#    wheelhouse, so it works where no registry is reachable (with a local base, see
#    deploy/base-image.sh). DOCKER_HOST is honoured.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=dpfl:0.1.0 base=python:3.11-slim torch_spec="torch==2.13.0"
python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --torch) torch_spec=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
wheels=$repo/deploy/wheelhouse
mkdir -p "$wheels"
rm -f "$wheels"/dpfl-*.whl
# The image's pins: constraints.txt without the host's CUDA torch stack.
grep -v -E '^(torch|torchvision|triton|nvidia-|cuda-)' "$repo/constraints.txt" > "$wheels/constraints.txt"
"$python" -m pip wheel -q --disable-pip-version-check -w "$wheels" -c "$wheels/constraints.txt" \
  "$repo[mnist]" "$torch_spec" 2>&1 | grep -v "is ignored: it is neither" || true
ls "$wheels"/dpfl-*.whl "$wheels"/torch-*.whl >/dev/null
DOCKER_BUILDKIT=0 docker build -q --network none --build-arg "BASE_IMAGE=$base" -t "$tag" \
  -f "$repo/deploy/Dockerfile" "$repo" >/dev/null
echo "$tag"
