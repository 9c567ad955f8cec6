#!/usr/bin/env bash
# Issue 16's throughput targets on one GPU host: the CUDA campaign through workers beside the
# CPU backend in this process, one run after another with the same seed and duration, for the
# binary under test and (optionally) a baseline binary, alternating; then one fixed case count
# through both binaries, whose verdicts must be equal (bench/NOTES.md v9).
#   ci/h200-speed.sh BIN OUT_DIR [SECONDS] [BASE_BIN]
# BIN and BASE_BIN are `smallseq` built with --features cuda. About 2 * (5 runs * (SECONDS +
# start-up)) + the verdict check: with SECONDS=30 and a baseline, under 8 minutes.
set -u
bin=$1 out=$2 secs=${3:-30} base=${4:-}
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache SMALLSEQ_CUDA_SYNC=blocking
mkdir -p "$out"
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
t0=$SECONDS
timeout 240 "$bin" fuzz --backend cuda --cases 1 --jobs 1 --force --out /tmp/speed-warm >/tmp/speed-warm.log 2>&1
say "kernel cache warmed in $((SECONDS - t0)) s ($(nproc) cores)"
tp() { # LABEL BIN ARGS...
  local name=$1 b=$2; shift 2
  timeout -k 10 $((secs + 120)) "$b" fuzz "$@" --seed 2051 --time "${secs}s" \
    --shrink-time 1s --force --out "/tmp/speed-$name" >"/tmp/speed-$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "/tmp/speed-$name.log")"
}
for who in new ${base:+base}; do
  b=$bin; [ "$who" = base ] && b=$base
  tp "$who-cpu-inproc" "$b" --backend cpu
  tp "$who-cuda32" "$b" --backend cuda --jobs 32
done
for who in new ${base:+base}; do
  b=$bin; [ "$who" = base ] && b=$base
  tp "$who-cuda16" "$b" --backend cuda --jobs 16
  tp "$who-cuda48" "$b" --backend cuda --jobs 48
  tp "$who-cpu-isolate" "$b" --backend cpu --isolate
done
if [ -n "$base" ]; then
  for who in new base; do
    b=$bin; [ "$who" = base ] && b=$base
    timeout -k 10 300 "$b" fuzz --backend cuda --jobs 32 --cases 600 --seed 2052 \
      --shrink-time 0 --force --out "/tmp/speed-eq-$who" >"/tmp/speed-eq-$who.log" 2>&1
    say "eq-$who: exit $?; $(grep -m1 'cases in' "/tmp/speed-eq-$who.log")"
  done
  python3 - /tmp/speed-eq-new/report.json /tmp/speed-eq-base/report.json <<'PY' | tee -a "$log"
import json, sys
def verdicts(p):
    r = json.load(open(p))
    fails = [(f["case"], f["property"], f["detail"].split("; stderr")[0]) for f in r["failures"]]
    return {k: r[k] for k in ("cases", "properties", "skip_reasons", "coverage", "paths",
                              "margins")}, fails
a, b = verdicts(sys.argv[1]), verdicts(sys.argv[2])
print("verdicts equal" if a == b else "VERDICTS DIFFER: %s" % [k for k in a[0] if a[0][k] != b[0][k]])
PY
fi
cp /tmp/speed-new-cuda32/report.json "$out/new-cuda32.json"
say "total $((SECONDS - t0)) s"
