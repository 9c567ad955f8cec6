# Sourced by the one-call device scripts (ci/h200-in-process.sh, h200-lanes-obwd.sh,
# h200-scale-adapters.sh, h200-judge-adapters.sh): run from the repository root with
# target/carry/ carried (ci/build-reach-carry.sh). Sets `carry`, `ss` (the carried smallseq),
# `out` ($OUT, else DEFAULT_OUT), `work` (scratch beside it), `log` ($out/LOG_NAME, default
# log.txt), `say`, the kernel cache, and `campaign`, which runs one timed fuzz campaign.
carry=$PWD/target/carry
ss=$carry/smallseq
out=${OUT:-$DEFAULT_OUT}
work=${WORK:-/tmp/device-call}
log=$out/${LOG_NAME:-log.txt}
mkdir -p "$out" "$work"
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache PYTHONUNBUFFERED=1
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
[ -f "$carry/kernel-cache.tar.xz" ] && tar xJf "$carry/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE"
say "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); kernel cache $(ls "$SMALLSEQ_KERNEL_CACHE" | wc -l) entries"

# campaign NAME SECONDS ARGS...: `smallseq fuzz ARGS` for SECONDS, seed CAMPAIGN_SEED (7301),
# into $work/NAME; logs its closing line, its stage rows and its first failures.
campaign() {
  local name=$1 secs=$2
  shift 2
  timeout -k 10 $((secs + 90)) "$ss" fuzz "$@" --time "${secs}s" --seed "${CAMPAIGN_SEED:-7301}" \
    --shrink-time 1s --force --out "$work/$name" >"$work/$name.log" 2>&1
  say "$name: exit $?; $(grep -m1 'cases in' "$work/$name.log")"
  grep -E '^\| (backend|judging|generation|allowances|emulation|reference|other|waiting for the merge) ' \
    "$work/$name/summary.md" 2>/dev/null | tee -a "$log"
  grep -m3 '^FAIL' "$work/$name.log" | cut -c1-300 | tee -a "$log"
}

# The summaries, reports and logs of the campaigns under $work, as ARCHIVE.
pack_campaigns() {
  tar czf "$1" -C "$work" $(cd "$work" && ls -d */summary.md */report.json *.log 2>/dev/null)
}

# cpu_against_in_process SECONDS: the CPU campaign and the CUDA one in this process at 16 jobs,
# alternated twice (their ratio, bench/NOTES.md v21), then 32 jobs.
cpu_against_in_process() {
  local round
  for round in 1 2; do
    campaign "cpu-$round" "$1" --backend cpu
    campaign "inproc16-$round" "$1" --backend cuda --in-process --jobs 16
  done
  campaign inproc32 "$1" --backend cuda --in-process --jobs 32
}
