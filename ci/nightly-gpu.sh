#!/usr/bin/env bash
# Nightly GPU CI: L1, a fixed seeded case set (the same cases every night, so a new failure
# is a regression), then L2, an open-ended campaign with a fresh seed and a time budget.
#
#   ci/nightly-gpu.sh --backend {cuda|hip|cpu|exec} --time DURATION --artifacts DIR
#                     [--l1-cases N] [--seed N] [--binary PATH] [--shard I/N]
#                     [--worker 'COMMAND ...'] [--jobs N]
#
# --shard I/N: this runner checks the cases whose index is I mod N of both tiers (give every
# runner of the night the same --seed); `smallseq merge` joins the N artifacts afterwards
# (docs/workers.md). --backend exec tests a worker program (--worker, docs/adapters.md).
# Builds smallseq with the backend's feature (or uses --binary, e.g. one built elsewhere),
# and leaves in DIR: l1/ and l2/ (report.json, report.html, junit.xml, summary.md, capsules/),
# a combined summary.md and report.html, and build.log. Exit status: 0 all passed, 1 a
# property failed, 2 the run could not start (build failure, no device when
# SMALLSEQ_REQUIRE_GPU=1, bad arguments).
# `cpu` exists so the script can be tried on any machine.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
backend="" time="" artifacts="" l1_cases=400 seed="" binary="" shard="" worker="" jobs=""
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=${2:-}; shift 2 ;;
    --time) time=${2:-}; shift 2 ;;
    --artifacts) artifacts=${2:-}; shift 2 ;;
    --l1-cases) l1_cases=${2:-}; shift 2 ;;
    --seed) seed=${2:-}; shift 2 ;;
    --binary) binary=${2:-}; shift 2 ;;
    --shard) shard=${2:-}; shift 2 ;;
    --worker) worker=${2:-}; shift 2 ;;
    --jobs) jobs=${2:-}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "nightly-gpu: unknown argument $1" >&2; usage ;;
  esac
done
case "$backend" in cuda|hip|cpu|exec) ;; *) echo "nightly-gpu: --backend must be cuda, hip, cpu or exec" >&2; exit 2 ;; esac
[ "$backend" = exec ] && [ -z "$worker" ] && { echo "nightly-gpu: --backend exec needs --worker" >&2; exit 2; }
[ -n "$time" ] && [ -n "$artifacts" ] || { echo "nightly-gpu: --time and --artifacts are required" >&2; exit 2; }
mkdir -p "$artifacts" || exit 2
artifacts=$(cd "$artifacts" && pwd)

built=no
features=()
if [ -z "$binary" ]; then
  built=yes
  case "$backend" in cuda|hip) features=(--features "$backend") ;; esac
  echo "== build (${backend})"
  if ! cargo build --release "${features[@]}" >"$artifacts/build.log" 2>&1; then
    tail -30 "$artifacts/build.log"; echo "nightly-gpu: build failed (log: $artifacts/build.log)"; exit 2
  fi
  binary=target/release/smallseq
fi
[ -x "$binary" ] || { echo "nightly-gpu: no executable at $binary" >&2; exit 2; }
binary=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")
seed=${seed:-$(date +%s)}

status=0
run_tier() {  # name, then smallseq fuzz arguments
  local name=$1; shift
  echo "== $name: smallseq fuzz --backend $backend $*"
  # Run inside DIR so capsule paths and repro commands are relative to the artifact's root.
  local extra=()
  [ -n "$shard" ] && extra+=(--shard "$shard")
  [ -n "$worker" ] && extra+=(--worker "$worker")
  [ -n "$jobs" ] && extra+=(--jobs "$jobs")
  (cd "$artifacts" && "$binary" fuzz --backend "$backend" --force --out "$name" "${extra[@]}" "$@")
  local rc=$?
  case $rc in
    0) ;;
    1) status=1 ;;
    *) echo "nightly-gpu: $name could not run (exit $rc)"; exit 2 ;;
  esac
}
# L1: the property suites with their committed regression seeds (when built here), then the
# fixed seed and case count. L2: the rest of the night, a new seed each run (printed).
proptests="not run (prebuilt --binary)"
if [ "$built" = yes ] && [ "$backend" != exec ] && [ "${shard%%/*}" = "${shard:+0}" ]; then
  echo "== l1: proptests (PROPTEST_CASES=${PROPTEST_CASES:=512})"
  if PROPTEST_CASES=$PROPTEST_CASES cargo test --release -p smallseq-proptests "${features[@]}" \
      >"$artifacts/proptests.log" 2>&1; then
    proptests="passed (PROPTEST_CASES=$PROPTEST_CASES)"
  else
    proptests="**FAILED** (PROPTEST_CASES=$PROPTEST_CASES): see proptests.log"; status=1
    grep -E "SKIP|Test failed|reproduce:|panicked" "$artifacts/proptests.log" | head -20
  fi
  grep -E "^SKIP" "$artifacts/proptests.log" || true
fi
run_tier l1 --cases "$l1_cases" --seed 1
run_tier l2 --time "$time" --seed "$seed"

{
  echo "# smallseq nightly: backend $backend${shard:+, shard $shard}, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "Binary: \`$("$binary" --version)\`. Reproduce a failure on a laptop: download this"
  echo "artifact, then run the repro command shown with the capsule's path inside it (drop"
  echo "\`--backend\` to re-judge the stored outputs on the CPU)."
  echo
  echo "## L1 (fixed: proptests, then $l1_cases cases, seed 1)"; echo
  echo "Proptests: $proptests."; echo; cat "$artifacts/l1/summary.md"; echo
  echo "## L2 ($time, seed $seed)"; echo; cat "$artifacts/l2/summary.md"
} > "$artifacts/summary.md"
# One page over both tiers (each tier also has its own l1/report.html, l2/report.html).
(cd "$artifacts" && "$binary" report l1 l2 --order name --out report.html) ||
  echo "nightly-gpu: no report.html over both tiers (this binary has no \`report\` command?)"
echo "== artifacts in $artifacts (summary.md, report.html, l1/, l2/)"
exit $status
