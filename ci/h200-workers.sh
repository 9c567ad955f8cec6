#!/usr/bin/env bash
# One device call's worker-process measurements on a GPU host (docs/workers.md):
#   ci/h200-workers.sh BIN OUT_DIR [SECONDS_PER_THROUGHPUT_RUN]
# 1. warms the kernel cache for the shipped build and the three planted-fault builds, side by
#    side; 2. campaign throughput, one run after another, same seed and duration: CUDA with
#    1, 16 and 32 workers, and the CPU backend in this process with a thread per core;
# 3. a campaign per planted kernel fault (SMALLSEQ_MUTANT_OOB_WRITE, _TRAP, _HANG), then the
#    repro line it printed, run as printed. Reports go to OUT_DIR (at most 8 files).
set -u
bin=$1 out=$2 secs=${3:-30}
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
say "host: $(nproc) cores; $(nvidia-smi -L | head -4 | tr '\n' ' ')"
t0=$SECONDS
for d in "" SMALLSEQ_MUTANT_OOB_WRITE SMALLSEQ_MUTANT_TRAP SMALLSEQ_MUTANT_HANG; do
  SMALLSEQ_KERNEL_DEFINES=$d timeout 240 "$bin" fuzz --backend cuda --cases 1 --jobs 1 \
    --force --out "/tmp/warm$d" >"/tmp/warm$d.log" 2>&1 &
done
wait
say "kernel cache warmed in $((SECONDS - t0)) s"
tp() { # NAME ARGS...: one throughput run
  local name=$1; shift
  timeout -k 10 $((secs + 120)) "$bin" fuzz "$@" --seed 2050 --time "${secs}s" --shrink-time 1s \
    --force --out "/tmp/$name" >"/tmp/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc; $(grep -m1 'cases in' "/tmp/$name.log")"
  cp "/tmp/$name/report.json" "$out/$name.json" 2>/dev/null
}
tp cuda-1 --backend cuda --jobs 1
tp cuda-16 --backend cuda --jobs 16
tp cuda-32 --backend cuda --jobs 32
tp cpu-inproc --backend cpu
for f in OOB_WRITE TRAP HANG; do
  name=fault-$(echo $f | tr 'A-Z_' 'a-z-')
  t1=$SECONDS
  SMALLSEQ_KERNEL_DEFINES=SMALLSEQ_MUTANT_$f timeout -k 10 200 "$bin" fuzz --backend cuda \
    --cases 200 --seed 7 --case-timeout 8s --shrink-time 0 --force --out "/tmp/$name" >"/tmp/$name.log" 2>&1
  rc=$?
  say "$name: exit $rc in $((SECONDS - t1)) s; $(grep -m1 'cases in' "/tmp/$name.log")"
  grep -E '^  (crash|hang|numeric_agreement) ' "/tmp/$name.log" | tee -a "$log"
  grep -m2 '^FAIL' "/tmp/$name.log" | cut -c1-300 | tee -a "$log"
  cmd=$(grep -m1 -o 'smallseq repro [^ ]* --backend cuda' "/tmp/$name.log")
  if [ -n "$cmd" ]; then
    timeout 120 "$bin" ${cmd#smallseq } --case-timeout 8s >"/tmp/$name-repro.log" 2>&1
    say "  repro as printed: exit $? ($(grep -E '^(crash|hang): FAIL' "/tmp/$name-repro.log" | cut -c1-160))"
  fi
  cp "/tmp/$name/report.json" "$out/$name.json" 2>/dev/null
done
say "total $((SECONDS - t0)) s"
