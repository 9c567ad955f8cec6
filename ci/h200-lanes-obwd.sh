#!/usr/bin/env bash
# One device call (under 9.5 minutes) for issues 32 and 33, with target/carry/ carried, built by
#   CARRY_VARIANTS="default FTB_D_FROM_O=1" ci/build-reach-carry.sh
# plus target/carry/cuda_d_from_o (cargo test --release --features cuda --test cuda_d_from_o
# --no-run, the printed binary, stripped):
# 1. issue 32: the CPU backend against the CUDA backend in this process (--in-process, 16 and
#    32 jobs), 20 s each, seed 7301, CPU and 16 jobs alternated twice (their ratio);
# 2. the GPU tests of the default build (every call in one allocation: backend/gpu/arena.rs);
# 3. issue 33 item 2: ci/h200-obwd.sh (bench with FTB_D_FROM_O off and on, a campaign of
#    FUZZ_TIME s with it on, its GPU tests and memcheck).
#   ci/h200-lanes-obwd.sh      writes $OUT/log.txt, $OUT/obwd/ and $OUT/lanes.tar.gz
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/h200-lanes}
mkdir -p "$out" /tmp/ln
carry=$PWD/target/carry
ss=$carry/smallseq
log=$out/log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); kernel cache $(ls "$SMALLSEQ_KERNEL_CACHE" | wc -l) entries"
run() { # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  timeout -k 10 $((secs + 60)) "$ss" fuzz "$@" --time "${secs}s" --seed 7301 --shrink-time 1s --force \
    --out "/tmp/ln/$name" >"/tmp/ln/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/ln/$name.log")"
  grep -E '^\| (backend|judging|generation|allowances|emulation|reference|other|waiting for the merge) ' \
    "/tmp/ln/$name/summary.md" 2>/dev/null | tee -a "$log"
  grep -m3 '^FAIL' "/tmp/ln/$name.log" | cut -c1-300 | tee -a "$log"
}
secs=${SCALE_SECS:-20}
for round in 1 2; do
  run "cpu-$round" "$secs" --backend cpu
  run "inproc16-$round" "$secs" --backend cuda --in-process --jobs 16
done
run inproc32 "$secs" --backend cuda --in-process --jobs 32
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 "${TEST_TIMEOUT:-150}" "$carry/cuda_backend" \
  --test-threads 1 > /tmp/ln/tests.log 2>&1
say "GPU tests (default build): exit $? ($(grep -E '^test result' /tmp/ln/tests.log | tail -1))"
grep -E '^test .* (ok|FAILED)$|panicked' /tmp/ln/tests.log | head -20 | tee -a "$log"
FUZZ_TIME=${FUZZ_TIME:-150} bash ci/h200-obwd.sh "$carry" "$out/obwd" 2>&1 | tail -40 >> "$log"
cp /tmp/ln/tests.log "$out/"
tar czf "$out/lanes.tar.gz" -C /tmp/ln $(cd /tmp/ln && ls -d */summary.md */report.json *.log 2>/dev/null)
say done
