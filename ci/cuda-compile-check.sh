#!/usr/bin/env bash
# CUDA kernels without a GPU: compiles kernels/small_seq.cu and kernels/fallback.cu with NVRTC
# exactly as the CUDA backend does (sm_90) and prints ptxas's registers, stack and spills per
# kernel; checks that every kernel mutant define passes NVRTC's front end (ci/cuda-ptx.sh;
# SMALLSEQ_CUDA_MUTANT_PTX=1 builds each to PTX, as the nightly CPU tier does). NVRTC and ptxas come from PyPI
# (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12), unpacked once into target/cuda-tools.
# Fails on a compile error, or on a small-seq kernel of the shipped build (no mutant define)
# that spills more than 4 bytes. Also runs the CUDA backend's unit tests, which need
# `--features cuda` and NVRTC (the kernel cache's): ci/backend-unit-tests.sh cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/cuda-tools.sh
# The backend's unit tests need the feature and NVRTC, no GPU (cudarc loads both at run time).
# They include the kernel cache's compile-once test, required here rather than skipped. Under
# `.ci/run` they ran already, in its cargo test with both features (SMALLSEQ_BACKEND_TESTS_RAN=1).
if [ "${SMALLSEQ_BACKEND_TESTS_RAN:-}" = 1 ]; then
  echo "== backend unit tests (cuda): ran in this run's cargo test (features cuda,hip)"
else
  ci/backend-unit-tests.sh cuda
fi
out=target/cuda-compile-check
# The NVRTC builds, plain and per kernel mutant define (ci/cuda-ptx.sh; under `.ci/run` they ran
# in the background during L0, SMALLSEQ_CUDA_PTX_BUILT=1).
[ "${SMALLSEQ_CUDA_PTX_BUILT:-}" = 1 ] || ci/cuda-ptx.sh
mutants=$(grep -o '"SMALLSEQ_MUTANT_[A-Z0-9_]*"' src/mutants.rs | tr -d '"' | sort -u)
[ "$(printf '%s\n' plain $mutants)" = "$(cat "$out/tags")" ] ||
  { echo "FAIL: $out holds other builds than plain and the catalogue's defines" >&2; exit 1; }
sort -k1,1 "$out/plain.log" | grep regs
for tag in plain $mutants; do
  last=$(tail -1 "$out/$tag.log")
  echo "$last"
  # The shipped build to PTX; a mutant define through the front end, or to PTX under
  # SMALLSEQ_CUDA_MUTANT_PTX=1 (ci/cuda-ptx.sh).
  [[ "$last" == *": compiled, worst spill "* ]] ||
    { [ "$tag" != plain ] && [[ "$last" == *": front end passed" ]]; } ||
    { echo "FAIL: $tag did not compile" >&2; exit 1; }
done
# The small-seq kernels may spill at most 4 bytes: the forward's at d128/d256 (ptxas 12.9),
# since it skips the dead row tile alone (SS_SKIP_DEAD_FWD=1; the key tile's skip too spilled
# 28-36 bytes and was 3-7 % slower, NOTES v7). More is a regression to look at. Only the
# shipped build is held to it: a mutant build only has to compile and run.
if awk '$1 ~ /^small_seq_/ && $(NF-1) == "spill" && $NF + 0 > 4 { bad = 1 }
        END { exit !bad }' "$out/plain.log"; then
  echo "FAIL: a small-seq kernel spills more than 4 bytes (the shipped build)"; exit 1
fi
