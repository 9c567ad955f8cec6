#!/usr/bin/env bash
# Builds here (no GPU needed) what ci/h200-reach.sh runs on the H200, into target/carry/ (an
# ignored path, carried to the device machine):
#   target/carry/smallseq              cargo build --release --features cuda
#   target/carry/cuda_backend          the GPU test binary (cargo test --release --features cuda
#                                      --no-run --test cuda_backend)
#   target/carry/kernel-cache.tar.xz   the shipped kernels compiled by the host's NVRTC
#                                      (ci/kernel-cache.sh): the H200 host runs no NVRTC, which
#                                      takes about two minutes there
# Binaries are stripped (the carry holds 64 MiB in all). CARRY_DIR puts it elsewhere (another
# ignored path, e.g. while a device call is carrying target/carry), CARRY_VARIANTS adds the
# kernel cache of variant defines.
#
#   [CARRY_DIR=target/carry2] [CARRY_VARIANTS="default NAME=V"] ci/build-reach-carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tdir=${CARGO_TARGET_DIR:-$PWD/target}
export CARGO_PROFILE_RELEASE_DEBUG=${CARGO_PROFILE_RELEASE_DEBUG:-0}
carry=${CARRY_DIR:-target/carry}
rm -rf "$carry" && mkdir -p "$carry"
cargo build -q --release --features cuda --bin smallseq
test_bin=$(cargo test -q --release --features cuda --test cuda_backend --no-run \
  --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_backend" and m.get("executable"):
        print(m["executable"])')
[ -x "$test_bin" ] || { echo "FAIL: no cuda_backend test binary" >&2; exit 1; }
cp "$tdir/release/smallseq" "$carry/smallseq"
cp "$test_bin" "$carry/cuda_backend"
strip "$carry/smallseq" "$carry/cuda_backend"
# ci/kernel-cache.sh runs target/release/examples/fill_kernel_cache: the target dir's.
[ "$tdir" = "$PWD/target" ] || [ -e target/release ] || ln -sfn "$tdir/release" target/release
ci/kernel-cache.sh "$carry" ${CARRY_VARIANTS:-default}
du -sh "$carry"/*
total=$(du -sb "$carry" | cut -f1)
[ "$total" -lt $((64 * 1024 * 1024)) ] || { echo "FAIL: $carry holds $total bytes, over the 64 MiB carry" >&2; exit 1; }
echo "== carry ready: run ci/h200-session.sh on the device with carry [\"$carry\"]"
