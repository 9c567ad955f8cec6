#!/usr/bin/env bash
# Adapters in L0 (CPU only): the Python kit's unit tests and those of bench/peers_jax.py's
# timer; then, with the release binary, numpy_reference against the Rust f64 reference on the
# stored capsules and a short seeded campaign that drives the worker protocol end to end
# through adapters/numpy_reference.py.
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
echo "== bench/peers_jax.py's device timer on a made-up trace"
"$py" -B -m unittest discover -s bench -p 'test_*.py' 2> "$log" || { tail -n 60 "$log"; exit 1; }
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
# A correct FlashAttention-2-rounding model declares no design: the envelope's judge must pass
# it (its range limits are listed apart), or the judge is wrong, not the model.
echo "== exec campaign through design_model.py --design fa2 (undeclared: the envelope)"
"$bin" fuzz --backend exec --worker "$py adapters/design_model.py --design fa2" --cases 150 --seed 17 --force --out target/l0/design-model || exit 1
# The same model built with flush-to-zero (fast math): the envelope allows what flushing loses
# (docs/judgement.md, "Declared designs"); the judge before it failed 3 of these cases.
echo "== exec campaign through design_model.py --design fa2 --ftz (undeclared: the envelope)"
"$bin" fuzz --backend exec --worker "$py adapters/design_model.py --design fa2 --ftz" --cases 150 --seed 17 --force --out target/l0/design-model-ftz || exit 1
# The same model declaring smallseq's own design is held to it, and fails (the judge is not
# blind to the design's deviations, only fair to them when none is declared).
echo "== the same campaign with the model declaring the project's design (must fail)"
"$bin" fuzz --backend exec --worker "$py adapters/design_model.py --design fa2 --declare project" --cases 150 --seed 17 \
  --shrink-time 0s --force --out target/l0/design-model-project > target/l0/design-model-project.log 2>&1
rc=$?
tail -n 1 target/l0/design-model-project.log
[ "$rc" = 1 ] || { echo "expected exit 1 (failures under the declared project design), got $rc"; exit 1; }
