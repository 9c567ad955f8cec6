#!/usr/bin/env bash
# Issue 31 item 5 and issue 32's question "what stops the host side from scaling", in one short
# device call (about 4 minutes), with target/carry/ carried (ci/build-reach-carry.sh):
# 1. torch SDPA flash alone at --jobs 16 for 60 s: cases/s against the 50 cases/s target, and
#    the protocol overhead per request (summary.md);
# 2. the CPU backend in-process at --jobs 1, 4, 8 and 16, 20 s each, same seed: does the
#    harness scale with cores (cases/s per job);
# 3. the CUDA backend at --jobs 8 and 16 (workers), 20 s each, same seed.
#   ci/h200-scaling.sh        writes $OUT/scaling-log.txt and $OUT/scaling.tar.gz
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/h200-scaling}
mkdir -p "$out" /tmp/sc
ss=$PWD/target/carry/smallseq
log=$out/scaling-log.txt
say() { echo "$*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
[ -f target/carry/kernel-cache.tar.xz ] && tar xJf target/carry/kernel-cache.tar.xz -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(git log --oneline -1)"
run() { # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  timeout -k 10 $((secs + 60)) "$ss" fuzz "$@" --time "${secs}s" --shrink-time 1s --force \
    --out "/tmp/sc/$name" >"/tmp/sc/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/sc/$name.log")"
  grep -iE 'protocol overhead|^\| (backend|judging|generation|allowances|emulation|reference|other) ' \
    "/tmp/sc/$name/summary.md" 2>/dev/null | tee -a "$log"
}
run flash16 60 --backend exec --worker 'python3 adapters/torch_sdpa.py --kernel flash' --seed 29 --jobs 16
for j in 1 4 8 16; do run "cpu$j" 20 --backend cpu --seed 7301 --jobs "$j"; done
for j in 8 16; do run "cuda$j" 20 --backend cuda --seed 7301 --jobs "$j"; done
tar czf "$out/scaling.tar.gz" -C /tmp/sc $(cd /tmp/sc && ls -d */summary.md */report.json *.log 2>/dev/null)
