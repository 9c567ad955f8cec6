#!/usr/bin/env bash
# A kernel change on one H200 in one device call (bench/NOTES.md v18): the stored f16 dS capsule
# on CUDA with the new and the old binary, memcheck on it, `smallseq bench` alternated old/new
# twice, then a campaign for what is left of BUDGET seconds (default 470).
#   B=DIR ci/h200-kernel-check.sh   (DIR holds smallseq-new and smallseq-base, release builds
#   with --features cuda, stripped; results under $OUT)
set -u
B=${B:-target/carry}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-470} - ($(date +%s) - T0) )); }
C=tests/capsules/stored/h200-f16-ds-saturation-dq-inf.safetensors
for v in new base; do
  echo "== capsule on CUDA, $v"
  timeout 170 $B/smallseq-$v repro $C --backend cuda > $OUT/cap-$v.log 2>&1; echo "repro $v rc=$? after $(( $(date +%s) - T0 )) s"
  grep -E "^(numeric_agreement|emulation_conformance|fallback_equivalence|determinism)" $OUT/cap-$v.log | cut -c1-200
done
echo "== memcheck on the capsule, new"
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 99 $B/smallseq-new repro $C --backend cuda > $OUT/sanc.log 2>&1; echo "memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/sanc.log
echo "== bench old vs new (µs), alternated"
for i in 1 2; do for v in base new; do
  timeout 70 $B/smallseq-$v bench --backend cuda --iters 20 > $OUT/bench-$v-$i.txt 2>&1; echo "bench $v $i rc=$?"
done; done
t=$(( $(left) - 15 ))
echo "== campaign ${t} s"
[ $t -gt 30 ] && { $B/smallseq-new fuzz --backend cuda --time ${t}s --seed ${SEED:-3305} --out $OUT/camp > $OUT/camp.log 2>&1; echo "campaign rc=$?"; tail -4 $OUT/camp.log; }
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.environ["OUT"] + "/camp/report.json"))
    print("campaign cases", r["cases"], "failures", len(r["failures"]), "elapsed", round(r.get("elapsed_s", 0), 1), "ds_past_range", r["dimensions"]["numeric_regime"]["hit"].get("ds_past_range"), "partial", r.get("partial"))
except Exception as e:
    print("no report", e)
PY
cp $OUT/camp/summary.md $OUT/camp-summary.md 2>/dev/null; cp $OUT/camp/report.json $OUT/camp-report.json 2>/dev/null; rm -rf $OUT/camp
