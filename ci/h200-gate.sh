#!/usr/bin/env bash
# One device call (≤ 10 min) of the checks that gate issues 16, 18 and 21 on an H200 host:
#   ci/h200-gate.sh BIN OUT_DIR
# 1. throughput (ci/h200-speed.sh, 20 s per run, quiet machine);
# 2. the fastest adapter alone (torch_sdpa --kernel flash, 60 s, --jobs 16), quiet machine;
# 3. side by side: every kernel mutant in its own process (`mutants --backend cuda --only M
#    --cases 300 --seed 1`, every case run so each property's kill count shows), the CUDA
#    calibration (conformance and rounding-bias budgets, 3,000 cases), and the planted
#    out-of-bounds write and hang in a campaign each, whose printed repro line is then run as
#    printed (it must fault again: exit 1).
# OUT_DIR gets log.txt, speed.txt, mutants.tar.gz, calibrate.json, calibrate.log, faults.tar.gz,
# adapter-speed.tar.gz (at most 8 files).
set -u
bin=$(readlink -f "$1") out=$(readlink -f "$2")
cd "$(dirname "$0")/.."
mkdir -p "$out"
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
log=$out/log.txt
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
say "gate: $(nproc) cores, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

timeout 300 ci/h200-speed.sh "$bin" /tmp/gate-speed 20 >/dev/null 2>&1
say "speed: exit $?"
cp /tmp/gate-speed/log.txt "$out/speed.txt"; sed 's/^/  /' "$out/speed.txt" | tee -a "$log" >/dev/null
cat "$out/speed.txt"

timeout -k 10 110 "$bin" fuzz --backend exec --worker "python3 adapters/torch_sdpa.py --kernel flash" \
  --time 60s --seed 17 --jobs 16 --shrink-time 0s --force --out /tmp/gate-adapter > /tmp/gate-adapter.log 2>&1
say "adapter speed (torch_sdpa flash, 16 jobs): exit $?; $(grep -m1 'cases in' /tmp/gate-adapter.log)"
grep -m1 -i 'protocol overhead' /tmp/gate-adapter.log /tmp/gate-adapter/summary.md 2>/dev/null | tee -a "$log"
tar czf "$out/adapter-speed.tar.gz" -C /tmp gate-adapter/report.json gate-adapter/summary.md gate-adapter.log 2>/dev/null

mkdir -p /tmp/gate-mut
pids=()
for m in nan-on-overflow dq-ulp-bias zeroed-small-row fallback-small-shapes-2x \
         head-index-above-16 softmax-first-tile-max f16-ds-unclamped round-toward-zero; do
  timeout -k 10 300 "$bin" mutants --backend cuda --only "$m" --cases 300 --seed 1 \
    --force --out "/tmp/gate-mut/$m" > "/tmp/gate-mut/$m.log" 2>&1 &
  pids+=($!)
done
timeout -k 10 300 "$bin" calibrate --backend cuda --cases 3000 --seed 1 --out "$out/calibrate.json" \
  > "$out/calibrate.log" 2>&1 &
cal=$!
mkdir -p /tmp/gate-faults
for f in OOB_WRITE HANG; do
  (
    name=/tmp/gate-faults/$f
    SMALLSEQ_KERNEL_DEFINES=SMALLSEQ_MUTANT_$f timeout -k 10 200 "$bin" fuzz --backend cuda \
      --cases 100 --seed 7 --case-timeout 8s --shrink-time 0 --force --out "$name" > "$name.log" 2>&1
    echo "campaign exit $?" >> "$name.log"
    cmd=$(grep -m1 -o '[^ ]*smallseq repro .*' "$name.log")
    if [ -n "$cmd" ]; then
      echo "\$ $cmd" >> "$name.log"
      # Exactly as printed.
      timeout -k 10 120 bash -c "$cmd" > "$name-repro.log" 2>&1
      echo "repro exit $?" >> "$name.log"
    fi
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
wait "$cal"; say "calibrate: exit $?"
tail -25 "$out/calibrate.log" | tee -a "$log"
for m in /tmp/gate-mut/*.log; do
  say "mutant $(basename "$m" .log): $(grep -E '^killed [0-9]+/' "$m" | head -1)"
  grep -E '^\| [a-z0-9-]+ \| (killed|SURVIVED|INTERRUPTED)' "$m" | tee -a "$log"
done
for f in OOB_WRITE HANG; do
  say "fault $f: $(grep -m1 'cases in' "/tmp/gate-faults/$f.log")"
  grep -E '^  (crash|hang) |campaign exit|repro exit|^\$ ' "/tmp/gate-faults/$f.log" | tee -a "$log"
  head -12 "/tmp/gate-faults/$f-repro.log" 2>/dev/null | sed 's/^/    /' | tee -a "$log"
done
tar czf "$out/mutants.tar.gz" -C /tmp gate-mut --exclude='*.safetensors' 2>/dev/null
tar czf "$out/faults.tar.gz" -C /tmp gate-faults --exclude='*.safetensors' 2>/dev/null
say "gate done"
