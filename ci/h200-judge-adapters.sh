#!/usr/bin/env bash
# One device call (under 9.5 minutes), target/carry/ carried, built by
#   CARRY_VARIANTS="default FTB_D_FROM_O=1" ci/build-reach-carry.sh
# plus target/carry/cuda_d_from_o (cargo test --release --features cuda --test cuda_d_from_o
# --no-run, the printed binary, stripped):
# 1. issue 33 item 2: the D-from-O GPU test, then a campaign of DFO_SECS (default 60) with
#    FTB_D_FROM_O=1 in process (seed 3371: 180 failures of 8,716 cases under the judge that
#    measured the fallback backward with the small-seq emulation's error, bench/NOTES.md v21);
# 2. issue 31: ci/h200-adapters.sh (every adapter's campaign side by side, ADAPTER_TIME,
#    ADAPTER_SEED, SMALLSEQ_SHARD, then triage within SMALLSEQ_TRIAGE_LIMIT).
#   ci/h200-judge-adapters.sh    writes $OUT/log.txt, $OUT/dfo.tar.gz and $OUT/adapters/
set -u
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/h200-judge-adapters WORK=/tmp/ja
. ci/device-call.sh
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 150 "$carry/cuda_d_from_o" \
  --test-threads 1 > "$work/dfo-test.log" 2>&1
say "cuda_d_from_o: exit $? ($(grep -E '^test result' "$work/dfo-test.log" | tail -1))"
grep -E 'panicked|^case |fallback backward' "$work/dfo-test.log" | head -8 | cut -c1-300 | tee -a "$log"
SMALLSEQ_KERNEL_DEFINES=FTB_D_FROM_O=1 CAMPAIGN_SEED=3371 campaign dfo "${DFO_SECS:-60}" \
  --backend cuda --in-process --jobs 16
pack_campaigns "$out/dfo.tar.gz"
ci/h200-adapters.sh "$ss" "$out/adapters" "${ADAPTER_TIME:-200s}" 0 > /dev/null 2>&1
cat "$out/adapters/log.txt" >> "$log"
say done
