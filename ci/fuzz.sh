#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time, two at a time, and prints the executions per
# target.
#   ci/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      (default: 20 s, every target)
# Installs cargo-fuzz when missing. Uses the nightly toolchain (AddressSanitizer) when one is
# installed; otherwise stable with RUSTC_BOOTSTRAP=1 and --sanitizer none (coverage-guided,
# no ASan: Rust's own bounds checks still turn memory errors into crashes).
# New corpus entries go to target/fuzz-corpus/TARGET; the committed seeds in fuzz/corpus are
# read, never written. A crash leaves its input in fuzz/artifacts/TARGET, prints it (base64)
# with the command that reproduces it, and fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
shift || true
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
# SMALLSEQ_FUZZ_TOOLCHAIN=stable forces the stable path (to test it where nightly exists).
if [ "${SMALLSEQ_FUZZ_TOOLCHAIN:-}" != stable ] && cargo +nightly --version >/dev/null 2>&1; then
  toolchain=(+nightly); sanitizer=()
else
  echo "no nightly toolchain: fuzzing on stable with RUSTC_BOOTSTRAP=1 --sanitizer none"
  export RUSTC_BOOTSTRAP=1
  toolchain=(); sanitizer=(--sanitizer none)
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
fi
export SMALLSEQ_FUZZ_QUIET=1
mkdir -p target/l0
stats=target/l0/fuzz-stats.txt
: > "$stats"
total=0
# Built once, then run two at a time: each target runs single-threaded for `secs` of wall time,
# so on two cores a pair takes the time of one (SMALLSEQ_FUZZ_JOBS=1: one after another).
cargo "${toolchain[@]}" fuzz build -O "${sanitizer[@]}"
jobs=${SMALLSEQ_FUZZ_JOBS:-2}
run_target() {
  local t=$1 rc=0
  mkdir -p "target/fuzz-corpus/$t"
  cargo "${toolchain[@]}" fuzz run -O "${sanitizer[@]}" "$t" "target/fuzz-corpus/$t" "fuzz/corpus/$t" \
    -- -max_total_time="$secs" -print_final_stats=1 > "target/l0/fuzz-$t.log" 2>&1 || rc=$?
  echo "$rc" > "target/l0/fuzz-$t.rc"
}
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  for t in "${targets[@]:i:jobs}"; do run_target "$t" & done
  wait
done
for t in "${targets[@]}"; do
  log="target/l0/fuzz-$t.log"
  if [ "$(cat "target/l0/fuzz-$t.rc")" -ne 0 ]; then
    grep -E -A3 "panicked|violat|ERROR|SUMMARY|Test unit written|INFO: Seed" "$log" | head -40 || true
    # The input itself, so a CI log alone reproduces the crash (the runner's files are gone).
    crash=$(ls -t "fuzz/artifacts/$t"/* 2>/dev/null | head -1)
    if [ -n "$crash" ] && [ "$(stat -c %s "$crash")" -le 65536 ]; then
      echo "fuzz target $t crashed; log: $log; reproduce anywhere:"
      echo "  echo '$(base64 -w0 "$crash")' | base64 -d > crash && cargo fuzz run $t crash"
      echo "  (then keep it as a regression seed: mv crash fuzz/corpus/$t/regress-<what>)"
    else
      echo "fuzz target $t crashed; log: $log; reproduce: cargo fuzz run $t ${crash:-fuzz/artifacts/$t/<crash file>}"
    fi
    exit 1
  fi
  n=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  n=${n:-0}
  total=$((total + n))
  echo "$t: $n executions in ${secs}s" | tee -a "$stats"
  # A target that ran nothing (a harness that exits at once, stats missing from the log)
  # tested nothing: that is a failure, not a pass.
  if [ "$n" -eq 0 ]; then
    echo "FAIL: fuzz target $t ran 0 executions; log: $log" >&2
    tail -20 "$log" >&2
    zero=1
  fi
done
echo "all targets: $total executions" | tee -a "$stats"
[ "${zero:-0}" -eq 0 ] || exit 1
