#!/usr/bin/env bash
# One device call (under 9.5 minutes), target/carry/ carried (ci/build-reach-carry.sh):
# 1. issue 32: the CPU backend against the CUDA backend in this process (--in-process, 16 and
#    32 jobs), SCALE_SECS each (default 15), seed 7301, CPU and 16 jobs alternated twice;
# 2. issue 31: ci/h200-adapters.sh (every adapter's campaign side by side, ADAPTER_TIME,
#    SMALLSEQ_SHARD, then triage within SMALLSEQ_TRIAGE_LIMIT), after 1 so it does not share
#    the host with it.
#   ci/h200-scale-adapters.sh    writes $OUT/log.txt, $OUT/scale.tar.gz and $OUT/adapters/
set -u
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/h200-scale-adapters WORK=/tmp/sa
. ci/device-call.sh
secs=${SCALE_SECS:-15}
cpu_against_in_process "$secs"
pack_campaigns "$out/scale.tar.gz"
ci/h200-adapters.sh "$ss" "$out/adapters" "${ADAPTER_TIME:-240s}" 0 > /dev/null 2>&1
cat "$out/adapters/log.txt" >> "$log"
say done
