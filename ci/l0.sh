#!/usr/bin/env bash
# L0: every CI run, CPU only. Formatting, lints, every test (reference proofs, dispatch
# boundaries, CPU backend properties, CLI end to end), the mutation catalogue, and a short
# seeded fuzz campaign.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== fmt"; cargo fmt --all -- --check
echo "== clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== tests"; cargo test --workspace --release
echo "== mutants"; cargo run --release -- mutants --cases 150 --seed 1 --out target/l0/mutants
echo "== fuzz"; cargo run --release -- fuzz --cases 300 --seed 1 --out target/l0/fuzz
