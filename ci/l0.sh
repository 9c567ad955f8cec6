#!/usr/bin/env bash
# L0: every CI run, CPU only. Formatting, lints, every test (reference proofs, dispatch
# boundaries, CPU backend properties, CLI end to end, the proptest suites and the committed
# fuzz seeds), the mutation catalogue, a short seeded fuzz campaign, and every cargo-fuzz
# target for a bounded time (ci/fuzz.sh installs cargo-fuzz when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== fmt"; cargo fmt --all -- --check; (cd fuzz && cargo fmt -- --check)
echo "== clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== tests"; cargo test --workspace --release
echo "== mutants"; cargo run --release -- mutants --cases 300 --seed 1 --out target/l0/mutants
echo "== fuzz"; cargo run --release -- fuzz --cases 300 --seed 1 --out target/l0/fuzz
echo "== cargo-fuzz targets"; ci/fuzz.sh "${SMALLSEQ_FUZZ_SECONDS:-20}"
