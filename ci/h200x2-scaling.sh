#!/usr/bin/env bash
# Issue 37 in one device call on a host with two GPUs (nvidia-h200-x2):
#   ci/h200x2-scaling.sh BIN OUT_DIR [SECONDS]
# 1. `fuzz --backend cuda --devices 0,1` against `--devices 0`, same seed and duration, one
#    after the other: cases/s and their ratio (target >= 1.8), and from nvidia-smi's
#    per-process accounting during the two-device run, that both GPUs ran workers;
# 2. `--shard 0/2` on device 0 and `--shard 1/2` on device 1 side by side, `smallseq merge`,
#    and the merged report against the unsharded run of the same cases (timings aside);
# 3. SMALLSEQ_MUTANT_OOB_WRITE on device 1 only (ci/fault-on-device.sh): its cases crash,
#    device 0's cases are judged. At most 8 files come back from OUT_DIR.
set -u
bin=$(realpath "$1") out=$2 secs=${3:-60}
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
say "host: $(nproc) cores; $(nvidia-smi -L | tr '\n' ' ')"
"$bin" fuzz --backend cuda --cases 1 --jobs 1 --force --out /tmp/warm >/tmp/warm.log 2>&1
rate() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['cases'], round(r['cases_per_s'],1))" "$1"; }
# 1. scaling
"$bin" fuzz --backend cuda --devices 0 --time "${secs}s" --seed 3701 --force --out /tmp/one >/tmp/one.log 2>&1
say "devices 0: exit $? cases, cases/s: $(rate /tmp/one/report.json)"
( while sleep 5; do nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader; done ) > /tmp/apps.txt 2>&1 &
mon=$!
"$bin" fuzz --backend cuda --devices 0,1 --time "${secs}s" --seed 3701 --force --out /tmp/two >/tmp/two.log 2>&1
say "devices 0,1: exit $? cases, cases/s: $(rate /tmp/two/report.json)"
kill $mon 2>/dev/null
say "GPUs that ran workers during the two-device run: $(cut -d, -f1 /tmp/apps.txt | sort -u | wc -l) ($(cut -d, -f1 /tmp/apps.txt | sort | uniq -c | tr '\n' ' '))"
python3 - "$log" <<'PY'
import json, sys
one = json.load(open("/tmp/one/report.json"))["cases_per_s"]
two = json.load(open("/tmp/two/report.json"))["cases_per_s"]
line = f"ratio two/one: {two / one:.2f} (target >= 1.8)"
print(line); open(sys.argv[1], "a").write(line + "\n")
PY
# 2. shards merged against the unsharded run
n=$(( secs * 60 ))
"$bin" fuzz --backend cuda --devices 0 --shard 0/2 --cases $n --seed 3702 --force --out /tmp/s0 >/tmp/s0.log 2>&1 &
"$bin" fuzz --backend cuda --devices 1 --shard 1/2 --cases $n --seed 3702 --force --out /tmp/s1 >/tmp/s1.log 2>&1 &
wait
"$bin" merge /tmp/s0 /tmp/s1 --force --out /tmp/merged >/tmp/merge.log 2>&1
say "merge: exit $?"
"$bin" fuzz --backend cuda --devices 0,1 --cases $n --seed 3702 --force --out /tmp/whole >/tmp/whole.log 2>&1
python3 - "$log" <<'PY'
import json, sys
skip = {"elapsed_s", "cases_per_s", "stages", "protocol_overhead_us", "command", "worker", "jobs", "commit"}
a, b = (json.load(open(f"/tmp/{d}/report.json")) for d in ("merged", "whole"))
diff = sorted(k for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k))
line = f"merged shards against the unsharded run: {'equal' if not diff else 'differ in ' + ', '.join(diff)} ({a['cases']} cases)"
print(line); open(sys.argv[1], "a").write(line + "\n")
PY
# 3. a planted fault on device 1 only
"$bin" fuzz --backend exec --devices 0,1 --jobs 4 --cases 400 --seed 7 --case-timeout 8s --shrink-time 0 --force \
  --worker "$(realpath ci/fault-on-device.sh) 1 SMALLSEQ_KERNEL_DEFINES=SMALLSEQ_MUTANT_OOB_WRITE $bin worker --backend cuda" \
  --out /tmp/fault1 >/tmp/fault1.log 2>&1
say "fault on device 1: exit $? (1 expected); $(python3 -c "import json; r=json.load(open('/tmp/fault1/report.json')); print(r['cases'], 'cases,', r['properties']['crash'], 'crash counts,', r['properties']['numeric_agreement'], 'numeric')")"
cp /tmp/one/report.json "$out/one.json"; cp /tmp/two/report.json "$out/two.json"
cp /tmp/merged/report.json "$out/merged.json"; cp /tmp/fault1/summary.md "$out/fault1.md"
