#!/usr/bin/env bash
# CUDA kernels without a GPU: compiles kernels/small_seq.cu and kernels/fallback.cu with NVRTC
# exactly as the CUDA backend does (sm_90), once plainly and once per kernel mutant define, and
# prints ptxas's registers, stack and spills per kernel. NVRTC and ptxas come from PyPI
# (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12), unpacked once into target/cuda-tools.
# Fails on a compile error, or on a small-seq kernel of the shipped build (no mutant define)
# that spills more than 36 bytes. Also runs the CUDA backend's unit tests, which need
# `--features cuda` and NVRTC (the kernel cache's).
set -euo pipefail
cd "$(dirname "$0")/.."
tools=target/cuda-tools
ci/cuda-tools.sh
# The backend's unit tests need the feature and NVRTC, no GPU (cudarc loads both at run time;
# it looks for libnvrtc.so, which the wheel names libnvrtc.so.12). They include the kernel
# cache's compile-once test, required here rather than skipped.
nvrtc_lib=$PWD/$tools/nvidia/cuda_nvrtc/lib
ln -sf libnvrtc.so.12 "$nvrtc_lib/libnvrtc.so"
LD_LIBRARY_PATH=$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} SMALLSEQ_REQUIRE_NVRTC=1 \
  cargo test -q --release --features cuda --lib backend:: 2>&1 | tail -2
out=target/cuda-compile-check
rm -rf "$out" && mkdir -p "$out"
# Every kernel mutant of the catalogue (src/mutants.rs, Mutant::kernel_define), one process per
# define and as many at once as there are cores (NVRTC and ptxas are single-threaded). A file
# whose source does not name a define compiles to the plain build's PTX, so nvrtc_compile.py
# compiles only the files that name it.
mutants=$(grep -o '"SMALLSEQ_MUTANT_[A-Z0-9_]*"' src/mutants.rs | tr -d '"' | sort -u)
printf '%s\n' plain $mutants |
  xargs -P "$(nproc)" -I{} sh -c \
    'd={}; [ "$d" = plain ] && d=""; python3 ci/nvrtc_compile.py "$0" "$1/{}" sm_90 $d > "$1/{}.log" 2>&1 || { echo "FAIL: {}"; cat "$1/{}.log"; exit 255; }' \
    "$tools" "$out"
sort -k1,1 "$out/plain.log" | grep regs
for tag in plain $mutants; do tail -1 "$out/$tag.log"; done
# The small-seq kernels may spill at most 36 bytes: the forward's at d128/d256 with the dead
# key tile skipped (SS_SKIP_DEAD_TILES=3, 28-36 bytes with ptxas 12.9), measured faster than
# its 4-byte spill without the skip (NOTES v6). More is a regression to look at. Only the
# shipped build is held to it: a mutant build only has to compile and run.
if awk '$1 ~ /^small_seq_/ && $(NF-1) == "spill" && $NF + 0 > 36 { bad = 1 }
        END { exit !bad }' "$out/plain.log"; then
  echo "FAIL: a small-seq kernel spills more than 36 bytes (the shipped build)"; exit 1
fi
