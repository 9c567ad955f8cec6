#!/usr/bin/env bash
# The GPU backends' own unit tests, no GPU needed: `cargo test --release --lib backend::` with
# the backend features. With `hip`: kernel names and launch lists of the HIP backend (it embeds
# the code objects of ci/hip-code-objects.sh, target/hip-co, which must be built). With `cuda`:
# the CUDA backend's, including the kernel cache's compile-once test with NVRTC from PyPI
# (ci/cuda-tools.sh; cudarc loads it at run time), required here rather than skipped.
#
#   ci/backend-unit-tests.sh cuda|hip|cuda,hip
#
# `.ci/run` runs it once with `cuda,hip` (one test binary, one compile of the crate's tests for
# both) and then passes SMALLSEQ_BACKEND_TESTS_RAN=1 to ci/hip-compile-check.sh and
# ci/cuda-compile-check.sh, which otherwise run it with their own feature.
set -euo pipefail
cd "$(dirname "$0")/.."
features=${1:?usage: ci/backend-unit-tests.sh cuda|hip|cuda,hip}
env=()
case ",$features," in *,hip,*)
  out=target/hip-co
  [ -s "$out/archs" ] || { echo "FAIL: $out/archs missing: run ci/hip-code-objects.sh first" >&2; exit 1; }
  read -r -a archs < "$out/archs"
  export HIP_PATH=${HIP_PATH:-/usr}
  env+=(SMALLSEQ_HIP_PREBUILT="$PWD/$out" SMALLSEQ_HIP_ARCHS="$(IFS=,; echo "${archs[*]}")")
esac
case ",$features," in *,cuda,*)
  ci/cuda-tools.sh
  # cudarc looks for libnvrtc.so, which the wheel names libnvrtc.so.12.
  nvrtc_lib=$PWD/target/cuda-tools/nvidia/cuda_nvrtc/lib
  ln -sf libnvrtc.so.12 "$nvrtc_lib/libnvrtc.so"
  env+=(LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SMALLSEQ_REQUIRE_NVRTC=1)
esac
echo "== cargo test --release --features $features --lib backend::"
log=target/backend-unit-tests.log
if env "${env[@]}" cargo test -q --release --features "$features" --lib backend:: > "$log" 2>&1; then
  tail -2 "$log"
else
  tail -40 "$log"; echo "FAIL: the backend unit tests with --features $features" >&2; exit 1
fi
