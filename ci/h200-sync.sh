#!/usr/bin/env bash
# Worker campaign throughput by CUDA synchronisation mode and job count, beside the CPU
# backend in this process, one run after another with the same seed and duration; then the
# planted hang, and the printed repro line of a planted out-of-bounds write, run as printed.
#   ci/h200-sync.sh BIN OUT_DIR [SECONDS]
set -u
bin=$1 out=$2 secs=${3:-30}
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
t0=$SECONDS
for d in "" SMALLSEQ_MUTANT_OOB_WRITE SMALLSEQ_MUTANT_HANG; do
  SMALLSEQ_KERNEL_DEFINES=$d timeout 240 "$bin" fuzz --backend cuda --cases 1 --jobs 1 \
    --force --out "/tmp/warm$d" >"/tmp/warm$d.log" 2>&1 &
done
wait
say "kernel cache warmed in $((SECONDS - t0)) s"
tp() { # NAME ENV ARGS...
  local name=$1 env=$2; shift 2
  env $env timeout -k 10 $((secs + 120)) "$bin" fuzz "$@" --seed 2051 --time "${secs}s" \
    --shrink-time 1s --force --out "/tmp/$name" >"/tmp/$name.log" 2>&1
  say "$name ($env): exit $?; $(grep -m1 'cases in' "/tmp/$name.log")"
}
tp cpu-inproc X=1 --backend cpu
tp cuda16-spin SMALLSEQ_CUDA_SYNC=spin --backend cuda --jobs 16
tp cuda16-yield SMALLSEQ_CUDA_SYNC=yield --backend cuda --jobs 16
tp cuda16-blocking SMALLSEQ_CUDA_SYNC=blocking --backend cuda --jobs 16
tp cuda24-blocking SMALLSEQ_CUDA_SYNC=blocking --backend cuda --jobs 24
tp cuda32-blocking SMALLSEQ_CUDA_SYNC=blocking --backend cuda --jobs 32
cp /tmp/cuda16-blocking/report.json "$out/cuda16-blocking.json"
cp /tmp/cpu-inproc/report.json "$out/cpu-inproc.json"
for f in OOB_WRITE HANG; do
  name=fault-$f
  SMALLSEQ_KERNEL_DEFINES=SMALLSEQ_MUTANT_$f timeout -k 10 200 "$bin" fuzz --backend cuda \
    --cases 100 --seed 7 --case-timeout 8s --shrink-time 0 --force --out "/tmp/$name" >"/tmp/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/$name.log")"
  grep -E '^  (crash|hang) ' "/tmp/$name.log" | tee -a "$log"
  grep -m1 '^FAIL' "/tmp/$name.log" | cut -c1-250 | tee -a "$log"
  cmd=$(grep -m1 -o 'smallseq repro [^ ]* --backend cuda' "/tmp/$name.log")
  if [ -n "$cmd" ]; then
    say "  \$ $cmd"
    timeout 120 "$bin" ${cmd#smallseq } --case-timeout 8s >"/tmp/$name-repro.log" 2>&1
    say "  repro exit $?"
    head -30 "/tmp/$name-repro.log" | tee -a "$log"
  fi
done
say "total $((SECONDS - t0)) s"
