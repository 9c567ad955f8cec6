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
out=${OUT:-/tmp/h200-in-process}
mkdir -p "$out" /tmp/ip
carry=$PWD/target/carry
ss=$carry/smallseq
log=$out/in-process-log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
[ -f "$carry/kernel-cache.tar.xz" ] && tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(git log --oneline -1)"
(timeout -k 10 "${SMOKE_TIMEOUT:-170}" python3 -m unittest discover -s adapters/tests -p 'test_frameworks.py' -v \
  >/tmp/ip/smoke.log 2>&1; echo "smoke exit $?" >>/tmp/ip/smoke.log) &
smoke=$!
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 170 "$carry/cuda_backend" --test-threads 1 \
  a_campaign_on_lanes_reports_what_one_stream_does > /tmp/ip/lanes-test.log 2>&1
say "lanes test: exit $? ($(grep -E '^test result' /tmp/ip/lanes-test.log | tail -1))"
grep -E 'panicked|assert' /tmp/ip/lanes-test.log | head -5 | tee -a "$log"
wait "$smoke"
say "$(tail -1 /tmp/ip/smoke.log); $(grep -cE ' ok$' /tmp/ip/smoke.log) ok, $(grep -cE '(FAIL|ERROR)$' /tmp/ip/smoke.log) failed"
grep -E '(FAIL|ERROR)$|skipped' /tmp/ip/smoke.log | head -20 | tee -a "$log"
run() { # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  timeout -k 10 $((secs + 90)) "$ss" fuzz "$@" --time "${secs}s" --seed 7301 --shrink-time 1s --force \
    --out "/tmp/ip/$name" >"/tmp/ip/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/ip/$name.log")"
  grep -E '^\| (backend|judging|generation|allowances|emulation|reference|other) ' \
    "/tmp/ip/$name/summary.md" 2>/dev/null | tee -a "$log"
  grep -m3 '^FAIL' "/tmp/ip/$name.log" | cut -c1-300 | tee -a "$log"
}
secs=${SCALE_SECS:-25}
for round in 1 2; do
  run "cpu-$round" "$secs" --backend cpu
  run "inproc16-$round" "$secs" --backend cuda --in-process --jobs 16
done
run inproc32 "$secs" --backend cuda --in-process --jobs 32
run inproc8 "$secs" --backend cuda --in-process --jobs 8
run workers "$secs" --backend cuda
cp /tmp/ip/smoke.log /tmp/ip/lanes-test.log "$out/"
tar czf "$out/in-process.tar.gz" -C /tmp/ip $(cd /tmp/ip && ls -d */summary.md */report.json *.log 2>/dev/null)
