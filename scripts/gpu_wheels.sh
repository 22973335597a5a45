#!/usr/bin/env bash
# Download PACKAGEs as wheels for the GPU machine (Python 3.12, x86_64 manylinux; no network there), without
# their dependencies: the machine's image already holds most of them, and its versions must stay in place.
#
#   scripts/gpu_wheels.sh OUT_DIR PACKAGE==VERSION ...   # then, there: pip install --no-index --no-deps OUT_DIR/*.whl
set -euo pipefail
OUT=${1:?usage: scripts/gpu_wheels.sh OUT_DIR PACKAGE ...}
shift
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT" "$@"
