#!/usr/bin/env bash
# Issue 32 on the device, one call (about 6 minutes), target/carry/ carried
# (ci/build-reach-carry.sh): the CUDA backend in the campaign's own process (`--in-process`,
# one stream per job) against its worker processes and the CPU backend, same host, same seed,
# one after another, twice for the two that set the ratio; beside them first, the GPU test
# that lanes report what one stream does and the adapters' framework smoke test (issue 35: the
# torch adapters' bias and dBias against the frameworks).
#   ci/h200-in-process.sh      writes $OUT/in-process-log.txt and $OUT/in-process.tar.gz
set -u
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/h200-in-process WORK=/tmp/ip LOG_NAME=in-process-log.txt
. ci/device-call.sh
(timeout -k 10 "${SMOKE_TIMEOUT:-170}" python3 -m unittest discover -s adapters/tests -p 'test_frameworks.py' -v \
  >$work/smoke.log 2>&1; echo "smoke exit $?" >>$work/smoke.log) &
smoke=$!
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 170 "$carry/cuda_backend" --test-threads 1 \
  a_campaign_on_lanes_reports_what_one_stream_does > $work/lanes-test.log 2>&1
say "lanes test: exit $? ($(grep -E '^test result' $work/lanes-test.log | tail -1))"
grep -E 'panicked|assert' $work/lanes-test.log | head -5 | tee -a "$log"
wait "$smoke"
say "$(tail -1 $work/smoke.log); $(grep -cE ' ok$' $work/smoke.log) ok, $(grep -cE '(FAIL|ERROR)$' $work/smoke.log) failed"
grep -E '(FAIL|ERROR)$|skipped' $work/smoke.log | head -20 | tee -a "$log"
secs=${SCALE_SECS:-25}
cpu_against_in_process "$secs"
campaign inproc8 "$secs" --backend cuda --in-process --jobs 8
campaign workers "$secs" --backend cuda
cp $work/smoke.log $work/lanes-test.log "$out/"
pack_campaigns "$out/in-process.tar.gz"
