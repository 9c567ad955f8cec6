#!/usr/bin/env bash
# Installs what `.ci/run` needs beyond a Rust toolchain, each only when missing:
#   - Debian's clang-19, lld-19, llvm-19 and libamdhip64-dev (apt-get; root, or sudo): the HIP
#     compile check, and the host model of a gfx942 wavefront (tests/hip_lane_model.rs);
#   - NVRTC and ptxas wheels from PyPI (python3 -m pip download) into target/cuda-tools: the
#     CUDA compile check;
#   - a venv with numpy and safetensors (ci/python-kit.sh, target/adapters-venv): the adapter
#     kit and the triage tests' standalone scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/hip-packages.sh
ci/cuda-tools.sh
ci/python-kit.sh > /dev/null
echo "   clang-19, lld-19, llvm-19, libamdhip64-dev and the CUDA tools are present, and the Python kit's venv"
