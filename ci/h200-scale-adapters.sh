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
out=${OUT:-/tmp/h200-scale-adapters}
mkdir -p "$out" /tmp/sa
carry=$PWD/target/carry
ss=$carry/smallseq
log=$out/log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
run() { # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  timeout -k 10 $((secs + 60)) "$ss" fuzz "$@" --time "${secs}s" --seed 7301 --shrink-time 1s --force \
    --out "/tmp/sa/$name" >"/tmp/sa/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/sa/$name.log")"
  grep -E '^\| (backend|judging|generation|allowances|emulation|reference|other|waiting for the merge) ' \
    "/tmp/sa/$name/summary.md" 2>/dev/null | tee -a "$log"
  grep -m3 '^FAIL' "/tmp/sa/$name.log" | cut -c1-300 | tee -a "$log"
}
secs=${SCALE_SECS:-15}
for round in 1 2; do
  run "cpu-$round" "$secs" --backend cpu
  run "inproc16-$round" "$secs" --backend cuda --in-process --jobs 16
done
run inproc32 "$secs" --backend cuda --in-process --jobs 32
tar czf "$out/scale.tar.gz" -C /tmp/sa $(cd /tmp/sa && ls -d */summary.md */report.json *.log 2>/dev/null)
ci/h200-adapters.sh "$ss" "$out/adapters" "${ADAPTER_TIME:-240s}" 0 > /dev/null 2>&1
cat "$out/adapters/log.txt" >> "$log"
say done
