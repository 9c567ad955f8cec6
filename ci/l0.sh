#!/usr/bin/env bash
# L0: every CI run, CPU only. Formatting, lints, every test (reference proofs, dispatch
# boundaries, CPU backend properties, CLI end to end, the proptest suites and the committed
# fuzz seeds), the mutation catalogue, a short seeded fuzz campaign, their report pages in a
# headless browser (ci/html-check.sh installs chromium when missing), the Python adapter kit
# and a campaign through the worker protocol (ci/adapters.sh). Each step is a stage
# (ci/stage.sh): a header, then its time. The cargo-fuzz targets run in the nightly CPU tier
# (.github/workflows/nightly-cpu.yml: installing cargo-fuzz and the AddressSanitizer build cost
# more than the 12 minutes L0 has on two cores); L0 replays their committed seeds in
# `cargo test` (tests/fuzz_corpus.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/stage.sh
stage fmt bash -c 'cargo fmt --all -- --check && cd fuzz && cargo fmt -- --check'
# Clippy with the release profile: the build scripts and proc macros it compiles (syn, serde_derive,
# clap_derive, …; the dev profile builds them at opt-level 3, `[profile.dev.package."*"]`) are
# then the ones `cargo test --release` uses, built once, not once per profile. The lints are
# the same (no code of the workspace depends on debug_assertions).
stage clippy cargo clippy --release --workspace --all-targets -- -D warnings
stage tests cargo test --workspace --release
stage mutants cargo run -q --release -- mutants --cases 300 --seed 1 --until-killed --out target/l0/mutants
stage fuzz-campaign cargo run -q --release -- fuzz --cases 300 --seed 1 --out target/l0/fuzz
stage report-pages ci/html-check.sh target/l0/fuzz target/l0/mutants/neighbour-slot-read
stage adapters env SMALLSEQ_BIN=target/release/smallseq ci/adapters.sh
