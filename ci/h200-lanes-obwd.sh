#!/usr/bin/env bash
# One device call (under 9.5 minutes) for issues 32 and 33, with target/carry/ carried, built by
#   CARRY_VARIANTS="default FTB_D_FROM_O=1" ci/build-reach-carry.sh
# plus target/carry/cuda_d_from_o (cargo test --release --features cuda --test cuda_d_from_o
# --no-run, the printed binary, stripped):
# 1. issue 32: the CPU backend against the CUDA backend in this process (--in-process, 16 and
#    32 jobs), 20 s each, seed 7301, CPU and 16 jobs alternated twice (their ratio);
# 2. the GPU tests of the default build (every call in one allocation: backend/gpu/arena.rs);
# 3. issue 33 item 2: ci/h200-obwd.sh (bench with FTB_D_FROM_O off and on, a campaign of
#    FUZZ_TIME s with it on, its GPU tests and memcheck).
#   ci/h200-lanes-obwd.sh      writes $OUT/log.txt, $OUT/obwd/ and $OUT/lanes.tar.gz
set -u
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/h200-lanes WORK=/tmp/ln
. ci/device-call.sh
secs=${SCALE_SECS:-20}
cpu_against_in_process "$secs"
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 "${TEST_TIMEOUT:-150}" "$carry/cuda_backend" \
  --test-threads 1 > $work/tests.log 2>&1
say "GPU tests (default build): exit $? ($(grep -E '^test result' $work/tests.log | tail -1))"
grep -E '^test .* (ok|FAILED)$|panicked' $work/tests.log | head -20 | tee -a "$log"
FUZZ_TIME=${FUZZ_TIME:-150} bash ci/h200-obwd.sh "$carry" "$out/obwd" 2>&1 | tail -40 >> "$log"
cp $work/tests.log "$out/"
pack_campaigns "$out/lanes.tar.gz"
say done
