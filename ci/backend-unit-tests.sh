#!/usr/bin/env bash
# The GPU backends' own unit tests, no GPU needed: `cargo test --release --lib backend::` with
# the backend features. With `hip`: kernel names and launch lists of the HIP backend (it embeds
# the code objects of ci/hip-code-objects.sh, target/hip-co, which must be built). With `cuda`:
# the CUDA backend's, including the kernel cache's compile-once test with NVRTC from PyPI
# (ci/cuda-tools.sh; cudarc loads it at run time), required here rather than skipped.
#
#   ci/backend-unit-tests.sh cuda|hip|cuda,hip
#
# ci/hip-compile-check.sh and ci/cuda-compile-check.sh run it with their own feature; `.ci/run`
# runs every test of the workspace with both features (the backend unit tests among them) and
# passes SMALLSEQ_BACKEND_TESTS_RAN=1 to those scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
features=${1:?usage: ci/backend-unit-tests.sh cuda|hip|cuda,hip}
. ci/feature-env.sh
feature_env "$features"
echo "== cargo test --release --features $features --lib backend::"
log=target/backend-unit-tests.log
if cargo test -q --release --features "$features" --lib backend:: > "$log" 2>&1; then
  tail -2 "$log"
else
  tail -40 "$log"; echo "FAIL: the backend unit tests with --features $features" >&2; exit 1
fi
