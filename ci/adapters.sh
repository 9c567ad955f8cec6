#!/usr/bin/env bash
# Adapters in L0 (CPU only): the Python kit's unit tests; then, with the release binary,
# numpy_reference against the Rust f64 reference on the stored capsules and a short seeded
# campaign that drives the worker protocol end to end through adapters/numpy_reference.py.
#
#   [SMALLSEQ_BIN=target/release/smallseq] ci/adapters.sh [--no-campaign]
#
# Runs under the venv of ci/python-kit.sh (target/adapters-venv: numpy, safetensors), which it
# creates when missing. Exit status: 0 passed, 1 a test or the campaign failed, 2 setup failed.
set -uo pipefail
cd "$(dirname "$0")/.."
campaign=yes
[ "${1:-}" = "--no-campaign" ] && campaign=no
py=$(ci/python-kit.sh) || exit 2
log=target/adapters-unittest.log
echo "== adapter kit unit tests"
env -u SMALLSEQ_BIN "$py" -m unittest discover -s adapters/tests 2> "$log" || { tail -n 60 "$log"; exit 1; }
tail -n 3 "$log"
[ "$campaign" = yes ] || exit 0
bin="${SMALLSEQ_BIN:-}"  # a caller that built the release binary already passes it
if [ -z "$bin" ]; then
  cargo build --release -q || exit 2
  bin="${CARGO_TARGET_DIR:-target}/release/smallseq"
fi
echo "== numpy_reference against the Rust reference on tests/capsules"
SMALLSEQ_BIN="$bin" "$py" -m unittest discover -s adapters/tests -p "test_against_rust_reference.py" 2> "$log" \
  || { tail -n 60 "$log"; exit 1; }
tail -n 3 "$log"
echo "== exec campaign through numpy_reference.py"
"$bin" fuzz --backend exec --worker "$py adapters/numpy_reference.py" --cases 40 --seed 1 --force --out target/l0/exec || exit 1
