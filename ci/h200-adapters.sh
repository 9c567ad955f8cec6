#!/usr/bin/env bash
# One device call: the external adapters' campaigns side by side on one GPU host, with the
# long CUDA campaign started in its own session beside them (collected by a later call with
# `ci/h200-adapters.sh BIN OUT collect`). Ends with `smallseq triage` over the adapter
# campaigns that wrote a report: OUT_DIR/triage/triage.md, triage.json and the scripts.
#   ci/h200-adapters.sh BIN OUT_DIR [ADAPTER_TIME] [CUDA_TIME]
# CUDA_TIME 0 starts no CUDA campaign (BIN then needs no cuda feature). SMALLSEQ_SHARD=I/N runs
# shard I of N of every adapter campaign (a campaign longer than one device call: run the
# shards in separate calls, then `smallseq merge` their directories). ADAPTER_SEED (default 17)
# is the campaigns' seed.
set -u
bin=$1 out=$2
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
if [ "${3:-}" = collect ]; then
  # While the long campaign finishes: the kernel mutants of issue 21, then the conformance
  # calibration of every tensor.
  timeout 300 "$bin" mutants --backend cuda --cases 300 --seed 1 \
    --only nan-on-overflow,dq-ulp-bias,zeroed-small-row,fallback-small-shapes-2x \
    --force --out /tmp/mut-cuda >/tmp/mut-cuda.log 2>&1
  say "mutants --backend cuda: exit $?"
  grep -E '^\|' /tmp/mut-cuda.log | tee -a "$log"
  timeout 200 "$bin" calibrate --backend cuda --cases 2500 --seed 1 --out "$out/calibrate.json" \
    >/tmp/calibrate.log 2>&1
  say "calibrate: exit $?"
  tail -25 /tmp/calibrate.log | tee -a "$log"
  while pgrep -f "fuzz --backend cuda --time" >/dev/null; do sleep 5; done
  say "$(grep -m1 'cases in' /tmp/fuzz-long.log)"
  grep -E '^  [a-z_]+ +pass' /tmp/fuzz-long.log | tee -a "$log"
  grep '^FAIL' /tmp/fuzz-long.log | cut -c1-400 | head -20 | tee -a "$log"
  cp /tmp/fuzz-long/report.json "$out/fuzz-long-report.json"
  tar czf "$out/fuzz-long.tar.gz" -C /tmp fuzz-long fuzz-long.log 2>/dev/null
  exit 0
fi
at=${3:-5m} ct=${4:-10m}
# Each campaign's backstop (SIGTERM: it writes the report of what ran): its time (600s, 5m,
# 1h) and 150 s to shrink and write its report.
case $at in
  *h) at_s=$(( ${at%h} * 3600 )) ;; *m) at_s=$(( ${at%m} * 60 )) ;; *s) at_s=${at%s} ;; *) at_s=$at ;;
esac
python3 -c 'import torch, jax; print("torch", torch.__version__, "jax", jax.__version__, torch.cuda.get_device_name())' | tee -a "$log"
[ "$ct" = 0 ] || setsid nohup "$bin" fuzz --backend cuda --time "$ct" --seed 2052 --jobs 8 --shrink-time 5s \
  --force --out /tmp/fuzz-long >/tmp/fuzz-long.log 2>&1 < /dev/null &
(timeout 300 python3 -m unittest discover -s adapters/tests -p 'test_frameworks.py' -v \
  >/tmp/smoke.log 2>&1; echo "smoke exit $?" >>/tmp/smoke.log) &
smoke=$!
mkdir -p /tmp/ad
pids=()
for spec in "sdpa-math|adapters/torch_sdpa.py --kernel math" \
            "sdpa-efficient|adapters/torch_sdpa.py --kernel efficient" \
            "sdpa-flash|adapters/torch_sdpa.py --kernel flash" \
            "sdpa-cudnn|adapters/torch_sdpa.py --kernel cudnn" \
            "varlen-flash|adapters/torch_varlen.py --kernel flash" \
            "jax-xla|adapters/jax_attention.py --implementation xla" \
            "jax-cudnn|adapters/jax_attention.py --implementation cudnn"; do
  name=${spec%%|*} script=${spec#*|}
  timeout -k 20 $((at_s + 150)) "$bin" fuzz --backend exec --worker "python3 $script" --time "$at" \
    --seed "${ADAPTER_SEED:-17}" --jobs 2 --shrink-time 5s ${SMALLSEQ_SHARD:+--shard "$SMALLSEQ_SHARD"} --force --out "/tmp/ad/$name" >"/tmp/ad/$name.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
for f in /tmp/ad/*.log; do
  n=$(basename "$f" .log)
  say "== $n: $(grep -m1 'cases in' "$f" || tail -2 "$f")"
  grep -E '^  [a-z_]+ +pass' "$f" | tee -a "$log"
  grep '^FAIL' "$f" | cut -c1-300 | head -6 | tee -a "$log"
done
# Triage of every campaign that wrote a report (groups, verdicts, standalone scripts), in
# one page: docs/local-loop.md, "Triage". Its --time ends it inside the limit, the largest
# groups first, with what it finished written after each group; the timeout is the backstop
# (SIGTERM: it still writes, SIGKILL 10 s later).
ran=()
for d in /tmp/ad/*/; do [ -e "$d/report.json" ] && ran+=("$d"); done
if [ "${#ran[@]}" -gt 0 ]; then
  mkdir -p "$out/triage"
  limit=${SMALLSEQ_TRIAGE_LIMIT:-300}
  timeout -k 10 "$limit" "$bin" triage "${ran[@]}" --out "$out/triage" --shrink-time 5s \
    --shrink-reruns 40 --time "$(( limit > 30 ? limit - 15 : limit * 2 / 3 ))s" \
    > "$out/triage/triage.log" 2>&1
  say "triage: exit $? ($(tail -2 "$out/triage/triage.log" | head -1))"
  grep -E '^[0-9]+\. ' "$out/triage/triage.log" | head -30 | tee -a "$log"
  # Each defect or harness-error group's standalone script on its own (torch or jax and numpy,
  # no smallseq): a defect group counts as confirmed only where its script reproduces (exit 1);
  # a limit group's verdict rests on its emulation, not on its script. Their paths come from
  # triage.json (`smallseq triage --out D` writes them into D/triage/).
  mapfile -t scripts < <(python3 -c '
import json, sys
for g in json.load(open(sys.argv[1]))["groups"]:
    if g["finding"]["verdict"] in ("defect", "harness_error") and g.get("script"):
        print(g["script"])' "$out/triage/triage.json" 2>/dev/null)
  SCRIPT_LIMIT=${SCRIPT_LIMIT:-90} ci/run-scripts.sh "$out/triage/scripts.txt" \
    "${scripts[@]}" > /dev/null
  say "scripts: $(cut -d: -f2 "$out/triage/scripts.txt" | sort | uniq -c | tr '\n' ';')"
else
  say "triage: no campaign wrote a report"
fi
# Not a bare `wait`: the long campaign is this shell's child too (setsid did not fork).
wait "$smoke"
# Its verdict in the log; the whole output travels inside adapters.tar.gz (the call brings back
# 8 files, and a triage archive over 15 MiB comes in parts that need the slots).
say "framework smoke test: $(tail -1 /tmp/smoke.log); $(grep -cE '^(FAIL|ERROR):' /tmp/smoke.log) failed"
grep -E '^(FAIL|ERROR):' /tmp/smoke.log | head -5 | tee -a "$log"
cp /tmp/smoke.log /tmp/ad/smoke.log
# What comes home: the triage (its representatives and scripts are copies, a few kB each) and
# each campaign's report, summary and log; the campaign folders (capsules of every failure,
# 488 MB on 2026-12-05) stay behind.
# A device call brings back files of at most 16 MiB: a larger archive (27 MB for 73 groups on
# 2026-12-05, unshrunk representatives) comes home in parts, joined with
# `cat triage.tar.xz.part-* | tar xJ`.
if [ -d "$out/triage" ]; then
  tar cJf "$out/triage.tar.xz" -C "$out" triage
  if [ "$(stat -c %s "$out/triage.tar.xz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15m -d "$out/triage.tar.xz" "$out/triage.tar.xz.part-" && rm "$out/triage.tar.xz"
  fi
  rm -rf "$out/triage"
fi
(cd /tmp/ad && tar czf "$out/adapters.tar.gz" ./*.log ./*/report.json ./*/summary.md 2>/dev/null)
ls -la "$out" | tee -a "$log"
