#!/usr/bin/env bash
# One H200 device call that does two owed runs side by side: ci/h200-reach.sh (issue 35: the
# GPU dropout/bias tests, memcheck, a CUDA campaign) and one shard of ci/h200-adapters.sh
# (issue 31: every adapter's campaign, then triage). Both only judge, so sharing the host
# changes how many cases run, not a verdict. With target/carry/ carried:
#   SMALLSEQ_SHARD=0/2 ci/h200-reach-adapters.sh [ADAPTER_TIME]
# Writes $OUT/reach-log.txt, $OUT/adapters-log.txt and $OUT/all.tar.gz (every log, the
# triage pages and scripts, the campaigns' reports and capsules): the tool brings back 8 files.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/h200-out}
mkdir -p "$out/reach" "$out/adapters"
ci/h200-adapters.sh "$PWD/target/carry/smallseq" "$out/adapters" "${1:-5m10s}" 0 &
ad=$!
sleep 20 # the adapters' interpreters start first; the reach tests then run on a busy host
OUT=$out/reach REACH_TEST_TIMEOUT=${REACH_TEST_TIMEOUT:-240} REACH_FUZZ_TIME=${REACH_FUZZ_TIME:-2m30s} \
  ci/h200-reach.sh
wait "$ad"
cp "$out/reach/log.txt" "$out/reach-log.txt"
cp "$out/adapters/log.txt" "$out/adapters-log.txt"
tar czf "$out/all.tar.gz" -C "$out" reach adapters
rm -rf "$out/reach" "$out/adapters"
ls -la "$out"
