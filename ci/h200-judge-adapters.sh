#!/usr/bin/env bash
# One device call (under 9.5 minutes), target/carry/ carried, built by
#   CARRY_VARIANTS="default FTB_D_FROM_O=1" ci/build-reach-carry.sh
# plus target/carry/cuda_d_from_o (cargo test --release --features cuda --test cuda_d_from_o
# --no-run, the printed binary, stripped). Three things side by side on one GPU host:
# 1. issue 31: ci/h200-adapters.sh (every adapter's campaign side by side, ADAPTER_TIME,
#    ADAPTER_SEED, SMALLSEQ_SHARD, then triage within SMALLSEQ_TRIAGE_LIMIT and each group's
#    standalone script run);
# 2. issue 31: ci/h200-findings.sh (the pending and confirmed capsules' scripts and adapters/findings/);
# 3. issue 33, in the background at DFO_JOBS (default 4) in-process jobs, so that the
#    adapters keep most of the cores: the D-from-O GPU test, then a campaign of DFO_SECS
#    (default 60) with the kernel defines DFO_DEFINES (default FTB_D_FROM_O=1; the carry's
#    kernel cache must hold them), seed DFO_SEED (default 3371), then compute-sanitizer
#    memcheck and racecheck on five cases (three on the fallback, two on small-seq) under the same defines (DFO_TEST=0 and
#    DFO_SANITIZE=0 leave out the test and the sanitizers, for a second call).
#   ci/h200-judge-adapters.sh    writes $OUT/log.txt, $OUT/dfo.tar.gz, $OUT/findings.tar.gz
#                                and $OUT/adapters/
set -u
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/h200-judge-adapters WORK=/tmp/ja
. ci/device-call.sh
defines=${DFO_DEFINES:-FTB_D_FROM_O=1}
dfo() {
  say "background campaign under $defines"
  if [ "${DFO_TEST:-1}" != 0 ]; then
    CARGO_MANIFEST_DIR=$PWD SMALLSEQ_REQUIRE_GPU=1 timeout -k 10 150 "$carry/cuda_d_from_o" \
      --test-threads 1 > "$work/dfo-test.log" 2>&1
    say "cuda_d_from_o: exit $? ($(grep -E '^test result' "$work/dfo-test.log" | tail -1))"
    grep -E 'panicked|^case |fallback backward' "$work/dfo-test.log" | head -8 | cut -c1-300 |
      tee -a "$log"
  fi
  SMALLSEQ_KERNEL_DEFINES=$defines CAMPAIGN_SEED=${DFO_SEED:-3371} campaign dfo \
    "${DFO_SECS:-60}" --backend cuda --in-process --jobs "${DFO_JOBS:-4}"
  # The tiled backward at D = 128 (GQA, causal, two query tiles), at D = 64 with a window, and
  # the scalar one (f32, dropout), under both tools.
  [ "${DFO_SANITIZE:-1}" = 0 ] && return
  local tool c
  mk() { "$ss" case new --out "$work/$1.safetensors" "${@:2}" > /dev/null || say "case new $1 failed"; }
  mk gqa128 --dtype bf16 --heads 4 --kv-heads 2 --head-dim 128 --q-lens 70,3 --kv-lens 90,5 --mask causal
  mk win64 --dtype f16 --heads 2 --head-dim 64 --q-lens 40,33 --kv-lens 70,40 --window=8,3
  mk f32drop --dtype f32 --heads 2 --head-dim 64 --q-lens 20,9 --kv-lens 24,30 --dropout 0.2
  # And the small-seq kernels (padding masks, no GQA, every slot at most 17 tokens), forward
  # and backward, at D = 128 and 64: the cases above all take the fallback. `smallseq run
  # --backend cpu` on these two says `path small_seq`.
  mk ss128 --dtype bf16 --heads 4 --head-dim 128 --q-lens 16,5,1 --kv-lens 17,9,3
  mk ss64 --dtype f16 --heads 2 --head-dim 64 --q-lens 12,7 --kv-lens 15,4
  for tool in memcheck racecheck; do
    for c in gqa128 win64 f32drop ss128 ss64; do
      SMALLSEQ_KERNEL_DEFINES=$defines timeout -k 5 90 compute-sanitizer --tool "$tool" \
        --error-exitcode 99 "$ss" run --backend cuda --case "$work/$c.safetensors" \
        --out "$work/$c-out.safetensors" > "$work/$tool-$c.log" 2>&1
      say "$tool $c: exit $? ($(grep -m1 -E '(ERROR|RACECHECK) SUMMARY' "$work/$tool-$c.log"))"
    done
  done
}
dfo &
dfo_pid=$!
(SMALLSEQ_BIN=$ss ci/h200-findings.sh "$work/findings" > "$work/findings.log" 2>&1
 say "findings: $(tr '\n' ';' < "$work/findings/findings.txt")") &
findings_pid=$!
ci/h200-adapters.sh "$ss" "$out/adapters" "${ADAPTER_TIME:-200s}" 0 > /dev/null 2>&1
cat "$out/adapters/log.txt" >> "$log"
wait "$findings_pid" "$dfo_pid"
tar czf "$out/findings.tar.gz" -C "$work" findings findings.log 2>/dev/null
pack_campaigns "$out/dfo.tar.gz"
say done
