#!/usr/bin/env bash
# Fills the CUDA kernel cache for a GPU host without a GPU here, so the host runs no NVRTC
# (about two minutes per kernel variant on the H200's host): NVRTC of the host's version from
# PyPI, examples/fill_kernel_cache.rs once per variant, the entries packed into
# BIN_DIR/kernel-cache.tar.xz, which ci/h200-session.sh unpacks.
#
#   ci/kernel-cache.sh BIN_DIR [VARIANT ...]
#
# A variant is a comma list of kernel defines, as ci/h200-session.sh's VARIANTS and
# FUZZ_VARIANTS take them (SS_ONE_QUERY=1,SS_ITEM32=1; `default`, or none given, for the shipped
# build); `seed=N` and SMALLSEQ_* entries are left out, as the session script leaves them out of
# the defines. NVRTC_VERSION (13.0.88: the H200 host's libnvrtc.so.13.0.88) picks the wheel; the
# cache key holds NVRTC's major.minor, so a host of another minor compiles afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: ci/kernel-cache.sh BIN_DIR [VARIANT ...]}
shift
# Two entries per variant, and a cache directory keeps 24 (src/backend/kernel_cache.rs).
[ $# -le 12 ] || { echo "ci/kernel-cache.sh: at most 12 variants (the cache keeps 24 entries)"; exit 2; }
ver=${NVRTC_VERSION:-13.0.88}
tools=target/nvrtc-$ver
if [ ! -e "$tools/nvidia/cu${ver%%.*}/lib/libnvrtc.so.${ver%%.*}" ]; then
  echo "   downloading NVRTC $ver (PyPI)"
  mkdir -p "$tools/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tools/wheels" \
    "nvidia-cuda-nvrtc==$ver"
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
fi
lib=$(dirname "$(find "$tools/nvidia" -name "libnvrtc.so.${ver%%.*}" | head -1)")
cargo build -q --release --features cuda --example fill_kernel_cache
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
. ci/variants.sh  # split_variant
for v in "${@:-default}"; do
  split_variant "$v"
  echo "== ${defs[*]:-(shipped build)}"
  LD_LIBRARY_PATH=$lib SMALLSEQ_KERNEL_CACHE=$cache SMALLSEQ_KERNEL_DEFINES="${defs[*]}" \
    target/release/examples/fill_kernel_cache sm_90 2>&1 | grep -v '^smallseq: compiling'
done
mkdir -p "$bin"
(cd "$cache" && tar cJf - -- *.kernel) > "$bin/kernel-cache.tar.xz"
echo "wrote $bin/kernel-cache.tar.xz ($(du -h "$bin/kernel-cache.tar.xz" | cut -f1), $(ls "$cache" | wc -l) entries)"
