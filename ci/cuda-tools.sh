#!/usr/bin/env bash
# NVRTC and ptxas from PyPI (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12), unpacked once into
# target/cuda-tools (no CUDA install, no GPU). Prints nothing when they are there.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=target/cuda-tools
ver=12.9.86
if [ ! -x "$tools/nvidia/cuda_nvcc/bin/ptxas" ] || [ ! -e "$tools/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  echo "   downloading NVRTC and ptxas $ver (PyPI)"
  mkdir -p "$tools/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tools/wheels" \
    "nvidia-cuda-nvrtc-cu12==$ver" "nvidia-cuda-nvcc-cu12==$ver"
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
  chmod +x "$tools/nvidia/cuda_nvcc/bin/ptxas"
fi
