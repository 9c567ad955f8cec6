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
out=${OUT:-/tmp/h200-judge-adapters}
mkdir -p "$out" /tmp/ja
carry=$PWD/target/carry
ss=$carry/smallseq
log=$out/log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 150 "$carry/cuda_d_from_o" \
  --test-threads 1 > /tmp/ja/dfo-test.log 2>&1
say "cuda_d_from_o: exit $? ($(grep -E '^test result' /tmp/ja/dfo-test.log | tail -1))"
grep -E 'panicked|^case |fallback backward' /tmp/ja/dfo-test.log | head -8 | cut -c1-300 | tee -a "$log"
secs=${DFO_SECS:-60}
SMALLSEQ_KERNEL_DEFINES=FTB_D_FROM_O=1 timeout -k 10 $((secs + 60)) "$ss" fuzz --backend cuda \
  --in-process --jobs 16 --time "${secs}s" --seed 3371 --shrink-time 1s --force --out /tmp/ja/dfo \
  > /tmp/ja/dfo.log 2>&1
say "D-from-O campaign: exit $?; $(grep -m1 'cases in' /tmp/ja/dfo.log)"
grep -m5 '^FAIL' /tmp/ja/dfo.log | cut -c1-300 | tee -a "$log"
tar czf "$out/dfo.tar.gz" -C /tmp/ja dfo-test.log dfo.log dfo/summary.md dfo/report.json 2>/dev/null
ci/h200-adapters.sh "$ss" "$out/adapters" "${ADAPTER_TIME:-200s}" 0 > /dev/null 2>&1
cat "$out/adapters/log.txt" >> "$log"
say done
