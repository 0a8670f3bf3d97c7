#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the pure-Python wheels the GPU scripts need that the device machine's image
# lacks, into bench/wheels/ (git-ignored, 17 KB), to carry with the run: jax-triton, for the Triton KV write.
# (The scripts need nothing else beyond the image: they import neither the server nor the GGUF reader.)
# bench/gpu_common.sh installs what it finds there.
# Usage: bash bench/gpu_wheels.sh; then run the GPU scripts with carry=["bench/wheels", ...].
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/wheels
mkdir -p "$DEST"
# The image's Python and Triton: 3.12 and triton 3.6; jax-triton 0.3.1 is the last release that takes
# triton 3.6 (0.4 asks for 3.7 or newer).
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp -d "$DEST" "jax-triton==0.3.1"
ls -l "$DEST"
