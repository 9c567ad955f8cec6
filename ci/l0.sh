#!/usr/bin/env bash
# L0: every CI run, CPU only. Formatting, lints, the module structure (ci/structure.py),
# every test (reference proofs, dispatch boundaries, CPU backend properties, CLI end to end,
# the proptest suites and the committed fuzz seeds), the mutation catalogue, a short seeded
# fuzz campaign, their report pages in a headless browser (ci/html-check.sh installs chromium
# when missing), the Python adapter kit and a campaign through the worker protocol
# (ci/adapters.sh). Each step is a stage
# (ci/stage.sh): a header, then its time. The cargo-fuzz targets run in the nightly CPU tier
# (.github/workflows/nightly-cpu.yml: installing cargo-fuzz and the AddressSanitizer build cost
# more than the 12 minutes L0 has on two cores); L0 replays their committed seeds in
# `cargo test` (tests/fuzz_corpus.rs).
#
#   ci/l0.sh [lint|test]      (both when left out; `.ci/run` runs `lint`, then `test`)
#
# SMALLSEQ_L0_FEATURES=cuda,hip lints, builds and tests with the GPU backends' features (as
# `.ci/run` does, with NVRTC from `feature_env cuda` of ci/feature-env.sh and the HIP objects
# from build.rs): their unit tests and the GPU test files then run in the same `cargo test`,
# the GPU ones printing SKIP here.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/stage.sh
part=${1:-all}
case $part in lint | test | all) ;; *) echo "usage: ci/l0.sh [lint|test]" >&2; exit 2 ;; esac
features=()
[ -n "${SMALLSEQ_L0_FEATURES:-}" ] &&
  features=(--features "$(echo ",$SMALLSEQ_L0_FEATURES" | sed 's/,/,smallseq-proptests\//g; s/^,//')")
if [ "$part" != test ]; then
stage fmt bash -c 'cargo fmt --all -- --check && cd fuzz && cargo fmt -- --check'
# Clippy with the release profile: the build scripts and proc macros it compiles (syn, serde_derive,
# clap_derive, …; the dev profile builds them at opt-level 3, `[profile.dev.package."*"]`) are
# then the ones `cargo test --release` uses, built once, not once per profile. The lints are
# the same (no code of the workspace depends on debug_assertions).
# With SMALLSEQ_L0_FEATURES the GPU backends' code is linted too; the build script then embeds
# no HIP code objects (SMALLSEQ_HIP_CLANG=none: lints need none, and its "no HIP compiler"
# warning is expected here), so clippy does not wait on clang. Without the hip feature both
# settings are unread.
stage clippy env SMALLSEQ_HIP_CLANG=none HIP_PATH="${HIP_PATH:-/usr}" \
  cargo clippy --release --workspace --all-targets "${features[@]}" -- -D warnings
# The module structure (issue 34): no import circle may span more than one folder of src/, and
# no source file may pass 800 lines. After clippy, so that a failure here still leaves the
# lints' verdict in the log.
stage structure python3 ci/structure.py --check
fi
[ "$part" = lint ] && exit 0
# The triage tests write and run standalone scripts, which need numpy and safetensors: the venv
# of ci/python-kit.sh (made by ci/prereqs.sh under .ci/run), not whatever python3 is on PATH.
SMALLSEQ_PYTHON=${SMALLSEQ_PYTHON:-$(ci/python-kit.sh)} || exit 2
export SMALLSEQ_PYTHON
# The HIP host model's clang-heavy tests (each kernel mutant and variant is a build of
# tests/hip_model/model.cpp) run beside the others, which leave the two cores idle about a
# fifth of their time (workers, signals and subprocesses wait). L0 runs the mutants' (about 65
# CPU-s); the benchmarked variants' (`kernel_variants_pass_the_model`, another 65 CPU-s: the
# non-default defines of bench/NOTES.md) run in the nightly CPU tier, since the same tree's
# clean-clone CI took 10 min 13 s one hour and 11 min 55 s the next on this machine, too close
# to L0's 12 minutes to carry them.
heavy=(kernel_mutants_fail_the_model)
nightly=(kernel_variants_pass_the_model)
stage test-build bash -c 'cargo test --workspace --release "$@" --no-run --message-format=json \
  > target/l0/test-build.json' _ "${features[@]}"
hip_model=$(python3 -c 'import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "hip_lane_model" and m.get("executable"):
        print(m["executable"])' target/l0/test-build.json)
[ -x "$hip_model" ] || { echo "FAIL: no hip_lane_model test binary" >&2; exit 1; }
"$hip_model" --exact "${heavy[@]}" > target/l0/hip-model.log 2>&1 &
hip_pid=$!
skips=()
for t in "${heavy[@]}" "${nightly[@]}"; do skips+=(--skip "$t"); done
stage tests cargo test --workspace --release "${features[@]}" -- "${skips[@]}"
hip_model_tests() {
  local rc=0
  wait "$hip_pid" || rc=$?
  cat target/l0/hip-model.log
  return "$rc"
}
stage hip-model-tests hip_model_tests
# The binary `cargo test` built for the CLI tests (with the same features): `cargo run` would
# resolve the dependencies' features without the dev-dependencies and compile again.
bin=target/release/smallseq
stage mutants "$bin" mutants --cases 300 --seed 1 --until-killed --force --out target/l0/mutants
stage fuzz-campaign "$bin" fuzz --cases 300 --seed 1 --force --out target/l0/fuzz
stage report-pages env SMALLSEQ_BIN="$bin" ci/html-check.sh target/l0/fuzz target/l0/mutants/neighbour-slot-read
stage adapters env SMALLSEQ_BIN="$bin" ci/adapters.sh
