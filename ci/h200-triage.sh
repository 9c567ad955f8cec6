#!/usr/bin/env bash
# Issue 17's triage in one device call (16 cores, torch and jax with CUDA, no network):
#   ci/h200-triage.sh BIN OUT [MINUTES]        (MINUTES: the whole call's wall time, default 9)
# (a) unless SKIP_SPEED is set, the fastest adapter alone (SPEED_ADAPTER, default torch_sdpa --kernel flash) for 60 s at
#     SPEED_JOBS (default 12) jobs: cases/s against the issue's 50 cases/s;
# (b) the protocol overhead per request, from each report.json (`protocol_overhead_us`: round
#     trip minus the worker's own elapsed_us, median and p90);
# (c) every adapter side by side with shrinking on until the time is nearly up, then
#     `smallseq triage` of each campaign (groups, verdicts, a standalone script per group from
#     adapters/standalone.py), and each group's script run.
# OUT gets at most 8 files, each under 16 MB: triage.log (every status line, as it happens),
# speed.tar.gz, and one tar per campaign group holding report.json, summary.md, the log, the
# shrunk capsules only, the standalone scripts and their output. Every step runs under
# `timeout` against one deadline, and each tar is written as soon as its campaign ends.
set -u
bin=$(readlink -f "$1") out=$(readlink -f "$2") minutes=${3:-9}
cd "$(dirname "$0")/.."
mkdir -p "$out"
start=$(date +%s)
deadline=$(( start + minutes * 60 - 15 ))
left() { echo $(( deadline - $(date +%s) )); }
# cap N: N seconds, or less so that no step ends later than 50 s past the deadline (the
# call stays under MINUTES + 35 s whatever hangs)
cap() { local c=$(( $(left) + 50 )); [ "$c" -lt 2 ] && c=2; [ "$1" -lt "$c" ] && c=$1; echo "$c"; }
log=$out/triage.log
say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
export PYTHONUNBUFFERED=1 SMALLSEQ_JAX_CACHE=/tmp/smallseq-jax-cache
work=/tmp/triage
rm -rf "$work" && mkdir -p "$work"
limit_bytes=$(( 15 * 1024 * 1024 ))

# tar_group OUTFILE NAME...: reports, logs and standalone files of campaigns NAME, and their
# shrunk capsules smallest first while the raw size stays under the limit.
tar_group() {
  local dest=$1; shift
  local list=$work/tar-list.$$ total=0 n=0 dropped=0 f s
  : > "$list"
  for name in "$@"; do
    for f in "$name/report.json" "$name/summary.md" "$name.log" "$name/standalone"; do
      [ -e "$work/$f" ] && echo "$f" >> "$list"
    done
    while read -r s f; do
      if [ $(( total + s )) -lt "$limit_bytes" ]; then
        echo "${f#"$work"/}" >> "$list"; total=$(( total + s )); n=$(( n + 1 ))
      else
        dropped=$(( dropped + 1 ))
      fi
    done < <(find "$work/$name/capsules" -name '*-shrunk.safetensors' -printf '%s %p\n' 2>/dev/null | sort -n)
  done
  timeout "$(cap 20)" tar czf "$dest" -C "$work" -T "$list"
  say "wrote $(basename "$dest"): $n shrunk capsules, $dropped left out (size), $(stat -c %s "$dest") bytes"
}

say "triage: bin $bin, $minutes min, $(nproc) cores"
timeout 60 python3 -c 'import torch, jax; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "jax", jax.__version__, jax.devices()[0].device_kind, torch.cuda.get_device_name())' 2>&1 | tail -1 | tee -a "$log"

# (a) + (b): the fastest adapter alone.
speed_adapter=${SPEED_ADAPTER:-adapters/torch_sdpa.py --kernel flash}
speed_jobs=${SPEED_JOBS:-12}
if [ -z "${SKIP_SPEED:-}" ] && [ "$(left)" -gt 300 ]; then
  say "speed: $speed_adapter, --jobs $speed_jobs, 60 s, no shrinking"
  timeout -k 10 150 "$bin" fuzz --backend exec --worker "python3 $speed_adapter" --time 60s --seed 17 \
    --jobs "$speed_jobs" --shrink-time 0s --force --out "$work/speed" > "$work/speed.log" 2>&1
  say "speed: exit $?; $(timeout 10 python3 ci/triage.py line speed "$work/speed/report.json")"
  timeout 30 tar czf "$out/speed.tar.gz" -C "$work" speed/report.json speed/summary.md speed.log 2>/dev/null
fi

# (c): every adapter side by side, shrinking on.
specs=("sdpa-math|adapters/torch_sdpa.py --kernel math"
       "sdpa-flash|adapters/torch_sdpa.py --kernel flash"
       "sdpa-efficient|adapters/torch_sdpa.py --kernel efficient"
       "sdpa-cudnn|adapters/torch_sdpa.py --kernel cudnn"
       "varlen-flash|adapters/torch_varlen.py --kernel flash"
       "jax-xla|adapters/jax_attention.py --implementation xla"
       "jax-cudnn|adapters/jax_attention.py --implementation cudnn")
post=120  # seconds kept for the standalone scripts and the tars
ct=$(( $(left) - post - 45 ))  # 45 s: worker start (torch/jax import, CUDA init)
if [ "$ct" -lt 30 ]; then
  say "campaigns: skipped, $(left) s left"
  exit 0
fi
say "campaigns: ${#specs[@]} adapters side by side, --time ${ct}s --jobs 2 --shrink-time 4s --seed 17"
(timeout 90 python3 - > "$work/probe.log" 2>&1 <<'EOF'
import sys
sys.path.insert(0, "adapters")
import smallseq_adapter as kit, torch_sdpa
for k in ("efficient", "cudnn"):
    a = torch_sdpa.adapter(["--kernel", k])
    try:
        kit.start(a)
        print(f"no-key LSE of torch_sdpa --kernel {k}: {a.no_key_lse} ({a.version})")
    except SystemExit as e:
        print(f"no-key LSE of torch_sdpa --kernel {k}: {e}")
EOF
) &
probe=$!
(timeout 150 python3 -m unittest discover -s adapters/tests -p test_frameworks.py > "$work/smoke.log" 2>&1;
 echo "smoke exit $?" >> "$work/smoke.log") &
smoke=$!
pids=()
for spec in "${specs[@]}"; do
  name=${spec%%|*} script=${spec#*|}
  timeout -k 10 $(( ct + 40 )) "$bin" fuzz --backend exec --worker "python3 $script" --time "${ct}s" \
    --seed 17 --jobs 2 --shrink-time 4s --force --out "$work/$name" > "$work/$name.log" 2>&1 &
  pids+=($!)
done
# status lines every 60 s from the partial reports, so a killed call still says something
while :; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ "$alive" = 1 ] || break
  sleep 20
  if [ $(( ( $(date +%s) - start ) % 60 )) -lt 20 ]; then
    for spec in "${specs[@]}"; do
      name=${spec%%|*}
      say "  $(timeout 10 python3 ci/triage.py line "$name" "$work/$name/report.json")"
    done
  fi
done
wait "$probe"; sed 's/^/  /' "$work/probe.log" | tail -4 | tee -a "$log"
say "campaigns done"
for spec in "${specs[@]}"; do
  name=${spec%%|*}
  say "$(timeout 10 python3 ci/triage.py line "$name" "$work/$name/report.json")"
  [ -e "$work/$name/report.json" ] || tail -n 3 "$work/$name.log" | cut -c1-400 | sed 's/^/  /' | tee -a "$log"
  grep -E '^  [a-z_]+ +pass' "$work/$name.log" | awk '$5 > 0' | sed 's/^/  /' | tee -a "$log"
done
for g in sdpa-math sdpa-flash sdpa-efficient sdpa-cudnn varlen-flash; do tar_group "$out/$g.tar.gz" "$g"; done
tar_group "$out/jax.tar.gz" jax-xla jax-cudnn

# Triage, then the standalone scripts: four groups per adapter at most, the first group of
# every adapter before the second of any, so a short call still covers each.
todo=$work/groups.tsv
: > "$todo"
for spec in "${specs[@]}"; do
  name=${spec%%|*}
  [ -e "$work/$name/report.json" ] || continue
  [ "$(left)" -gt 30 ] || { say "triage: out of time"; break; }
  mkdir -p "$work/$name/standalone"
  timeout -k 5 "$(cap 60)" "$bin" triage "$work/$name" --out "$work/$name/standalone" --shrink-time 0s \
    > "$work/$name/standalone/triage.log" 2>&1
  say "$name: triage exit $?: $(tail -2 "$work/$name/standalone/triage.log" | head -1)"
  timeout 20 python3 ci/triage.py scripts "$work/$name/standalone/triage.json" 4 \
    | awk -F'\t' -v n="$name" '{ print $1 "\t" n "\t" $0 }' >> "$todo"
done
sort -s -n -k1,1 "$todo" | while IFS=$'\t' read -r i name _ count verdict repro kind; do
  [ "$repro" != - ] || { say "$name group $i ($count failures, $verdict): no script: $kind"; continue; }
  budget=$(( $(left) - 5 )); [ "$budget" -gt 45 ] && budget=45
  [ "$budget" -ge 5 ] || { say "standalone: out of time"; break; }
  timeout -k 5 "$budget" python3 "$repro" > "$repro.out" 2>&1
  rc=$?
  result=$(case $rc in 1) echo reproduced;; 0) echo "not reproduced";; 2) echo refused;; 3) echo "script failed";; *) echo "exit $rc";; esac)
  say "$name group $i ($count failures, $verdict): $result: $kind"
  grep -E '^  (o|lse|dq|dk|dv) |^  slots|no-key LSE declared|Error' "$repro.out" | head -8 | sed 's/^/    /' | tee -a "$log"
done
for g in sdpa-math sdpa-flash sdpa-efficient sdpa-cudnn varlen-flash; do
  [ -d "$work/$g/standalone" ] && tar_group "$out/$g.tar.gz" "$g"
done
{ [ -d "$work/jax-xla/standalone" ] || [ -d "$work/jax-cudnn/standalone" ]; } && tar_group "$out/jax.tar.gz" jax-xla jax-cudnn
if kill -0 "$smoke" 2>/dev/null; then kill -- "$smoke" 2>/dev/null; fi
say "framework smoke test: $(tail -1 "$work/smoke.log" 2>/dev/null)"
grep -E '^(FAIL|ERROR):' "$work/smoke.log" 2>/dev/null | head -8 | tee -a "$log"
ls -la "$out" | tee -a "$log"
say "triage done"
