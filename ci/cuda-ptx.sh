#!/usr/bin/env bash
# The compile step of the CUDA compile check (ci/cuda-compile-check.sh): kernels/small_seq.cu
# and kernels/fallback.cu through NVRTC and ptxas -v for sm_90 (the shipped build: registers,
# spills), and once per kernel mutant define of the catalogue (src/mutants.rs,
# Mutant::kernel_define), into target/cuda-compile-check/<tag>.log (<tag>: plain or the define).
# A mutant define goes through NVRTC's front end only (nvrtc_compile.py --front-end: parsing,
# semantic analysis, template instantiation; 0.1 s where a full build of both files takes 85 s
# of one core here, and a define can only break the source, not code generation):
# SMALLSEQ_CUDA_MUTANT_PTX=1 builds each to PTX through ptxas too, as the nightly CPU tier does
# (.github/workflows/nightly-cpu.yml). One process per build and as many at once as there are
# cores (NVRTC and ptxas are single-threaded). A file whose source does not name a define
# compiles to the plain build's PTX, so nvrtc_compile.py compiles only the files that name it.
# `.ci/run` starts it in the background while cargo builds and tests; ci/cuda-compile-check.sh
# then reports and gates on the logs.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
tools=target/cuda-tools
ci/cuda-tools.sh
out=target/cuda-compile-check
rm -rf "$out" && mkdir -p "$out"
mutants=$(grep -o '"SMALLSEQ_MUTANT_[A-Z0-9_]*"' src/mutants.rs | tr -d '"' | sort -u)
printf '%s\n' plain $mutants > "$out/tags"
mode=--front-end what="through the front end only"
[ "${SMALLSEQ_CUDA_MUTANT_PTX:-}" = 1 ] && mode="" what="to PTX"
xargs -P "$(nproc)" -I{} sh -c \
  'd={} m=$2; [ "$d" = plain ] && d="" m=""; python3 ci/nvrtc_compile.py $m "$0" "$1/{}" sm_90 $d > "$1/{}.log" 2>&1 || { echo "FAIL: {}"; cat "$1/{}.log"; exit 255; }' \
  "$tools" "$out" "$mode" < "$out/tags"
echo "== compiled $(wc -l < "$out/tags") NVRTC builds (the mutant defines' $what) in $(($(date +%s) - t0)) s"
