#!/usr/bin/env bash
# The compile step of the CUDA compile check (ci/cuda-compile-check.sh): kernels/small_seq.cu
# and kernels/fallback.cu through NVRTC and ptxas -v for sm_90, plainly and once per kernel
# mutant define of the catalogue (src/mutants.rs, Mutant::kernel_define), into
# target/cuda-compile-check/<tag>.log (<tag>: plain or the define). One process per define and
# as many at once as there are cores (NVRTC and ptxas are single-threaded). A file whose source
# does not name a define compiles to the plain build's PTX, so nvrtc_compile.py compiles only
# the files that name it. `.ci/run` starts it in the background, beside the HIP code objects,
# while cargo builds and tests; ci/cuda-compile-check.sh then reports and gates on the logs.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
tools=target/cuda-tools
ci/cuda-tools.sh
out=target/cuda-compile-check
rm -rf "$out" && mkdir -p "$out"
mutants=$(grep -o '"SMALLSEQ_MUTANT_[A-Z0-9_]*"' src/mutants.rs | tr -d '"' | sort -u)
printf '%s\n' plain $mutants > "$out/tags"
xargs -P "$(nproc)" -I{} sh -c \
  'd={}; [ "$d" = plain ] && d=""; python3 ci/nvrtc_compile.py "$0" "$1/{}" sm_90 $d > "$1/{}.log" 2>&1 || { echo "FAIL: {}"; cat "$1/{}.log"; exit 255; }' \
  "$tools" "$out" < "$out/tags"
echo "== compiled $(wc -l < "$out/tags") NVRTC builds in $(($(date +%s) - t0)) s"
