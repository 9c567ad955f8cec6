#!/usr/bin/env bash
# One H200 device call (under 8 minutes) for issue 35 items 1 and 2 on the GPU: dropout and the
# additive bias in the CUDA fallback kernels. Run from the repo root with target/carry/ carried
# (ci/build-reach-carry.sh builds it here):
#   ci/h200-reach.sh            logs under $OUT (default /tmp/h200-reach)
# 1. the GPU tests (target/carry/cuda_backend, every test, SMALLSEQ_REQUIRE_GPU=1), among them
#    the dropout and bias ones: campaign_dropout_and_bias_cases_pass_every_property,
#    dropout_keep_mask_is_the_references, score_terms_match_the_reference_and_the_cpu;
# 2. compute-sanitizer memcheck of two of them (50 dropout and bias cases: every p, every
#    broadcast, -inf entries, ALiBi, forward and backward with dBias) and of a 20-case fuzz
#    campaign, beside
# 3. a 3-minute `smallseq fuzz --backend cuda` campaign (seed 3535).
# REACH_TEST_TIMEOUT (s) and REACH_FUZZ_TIME change the first two limits, REACH_SAN_CASES the
# sanitized campaign's cases (20; memcheck ran 20 out of its 85 s on an H100).
# Time: at most 180 s, then at most 245 s for 2 and 3 together (timeouts), about 7 minutes.
# Writes $OUT/log.txt (the summary), tests.log, memcheck-tests.log, memcheck-fuzz.log,
# fuzz.log and fuzz-report.tar.gz.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/h200-reach}
mkdir -p "$out"
carry=$PWD/target/carry
ss=$carry/smallseq
log=$out/log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-reach-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
say "reach: $(nproc) cores, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(git log --oneline -1 2>/dev/null)"
[ -x "$ss" ] && [ -x "$carry/cuda_backend" ] ||
  { say "FAIL: $carry lacks smallseq or cuda_backend (run ci/build-reach-carry.sh, carry target/carry)"; exit 1; }
if [ -f "$carry/kernel-cache.tar.xz" ]; then
  tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
  say "kernel cache: $(ls "$SMALLSEQ_KERNEL_CACHE" | wc -l) entries"
fi
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)

# 1. The GPU tests; the test binary finds tests/capsules/cuda from CARGO_MANIFEST_DIR.
CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 "${REACH_TEST_TIMEOUT:-180}" "$carry/cuda_backend" \
  --test-threads 1 > "$out/tests.log" 2>&1
say "GPU tests: exit $? ($(grep -E '^test result' "$out/tests.log" | tail -1))"
grep -E '^test .* (ok|FAILED|ignored)$|^SKIP|worst rel err|cases, [0-9]+ failures|campaign seed|^seed ' \
  "$out/tests.log" | tee -a "$log"

# 2 and 3 side by side: the sanitizer's cases are small, the campaign is judged, not timed.
(
  if [ -z "$san" ]; then
    echo "no compute-sanitizer on this host" > "$out/memcheck-tests.log"; exit 0
  fi
  CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 140 "$san" --tool memcheck \
    --error-exitcode 99 "$carry/cuda_backend" --test-threads 1 \
    dropout_keep_mask_is_the_references score_terms_match_the_reference_and_the_cpu \
    > "$out/memcheck-tests.log" 2>&1
  echo "memcheck exit $?" >> "$out/memcheck-tests.log"
  timeout -k 10 85 "$san" --tool memcheck --error-exitcode 99 "$ss" fuzz --backend cuda \
    --cases "${REACH_SAN_CASES:-20}" --seed 35 --shrink-time 0 --force --out /tmp/reach-san > "$out/memcheck-fuzz.log" 2>&1
  echo "memcheck exit $?" >> "$out/memcheck-fuzz.log"
) &
sanpid=$!
timeout -k 10 240 "$ss" fuzz --backend cuda --time "${REACH_FUZZ_TIME:-3m}" --seed 3535 --shrink-time 5s --force \
  --out /tmp/reach-fuzz > "$out/fuzz.log" 2>&1
say "fuzz (${REACH_FUZZ_TIME:-3m}, seed 3535): exit $?; $(grep -m1 'cases in' "$out/fuzz.log")"
tail -30 "$out/fuzz.log" | tee -a "$log" > /dev/null
tar czf "$out/fuzz-report.tar.gz" -C /tmp reach-fuzz/report.json reach-fuzz/summary.md 2>/dev/null
wait "$sanpid"
for f in memcheck-tests memcheck-fuzz; do
  say "$f: $(grep -E 'ERROR SUMMARY|memcheck exit|no compute-sanitizer' "$out/$f.log" | tr '\n' ' ')"
done
say "done"
