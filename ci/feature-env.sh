# Sourced: `feature_env FEATURES` (cuda, hip or cuda,hip) exports what a build and test run
# with those features of the smallseq crate needs without a GPU:
#   hip:  the code objects of ci/hip-code-objects.sh (target/hip-co, which must be built) as
#         SMALLSEQ_HIP_PREBUILT, for the archs it built, and HIP_PATH (Debian's libamdhip64);
#   cuda: NVRTC from PyPI (ci/cuda-tools.sh) on LD_LIBRARY_PATH, where cudarc loads it at run
#         time, and SMALLSEQ_REQUIRE_NVRTC=1, so the kernel cache's compile-once test runs
#         rather than skips.
feature_env() {
  case ",$1," in *,hip,*)
    local out=target/hip-co archs
    [ -s "$out/archs" ] || { echo "FAIL: $out/archs missing: run ci/hip-code-objects.sh first" >&2; return 1; }
    read -r -a archs < "$out/archs"
    export HIP_PATH=${HIP_PATH:-/usr}
    export SMALLSEQ_HIP_PREBUILT="$PWD/$out" SMALLSEQ_HIP_ARCHS="$(IFS=,; echo "${archs[*]}")"
  esac
  case ",$1," in *,cuda,*)
    ci/cuda-tools.sh
    # cudarc looks for libnvrtc.so, which the wheel names libnvrtc.so.12.
    local nvrtc_lib=$PWD/target/cuda-tools/nvidia/cuda_nvrtc/lib
    ln -sf libnvrtc.so.12 "$nvrtc_lib/libnvrtc.so"
    export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SMALLSEQ_REQUIRE_NVRTC=1
  esac
}
