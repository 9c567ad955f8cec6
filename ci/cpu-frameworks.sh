#!/usr/bin/env bash
# The framework adapters on the CPU, for the nightly CPU tier (L1): PyTorch's CPU kernels
# (SDPA math and flash) and JAX's XLA attention, from PyPI into a venv of their own, judged by
# this commit's binary, then triaged. L0 cannot carry them (the torch wheel set from PyPI is
# about 3 GB), and without them no run of adapters/tests/test_frameworks.py ever has torch.
#
#   ci/cpu-frameworks.sh OUT [TIME] [SEED]     (TIME per campaign, default 5m; SEED default 1)
#
# Exit 1 when a triage group is anything but a characterised design or range limit (a defect,
# a harness error, or a group left untriaged): on 2026-12-07 the CPU campaigns ended with none
# (adapters/FINDINGS.md, "CPU, 2026-12-07"), so a red night is a new finding or a regression
# of the judge, with its group, representative and standalone script under OUT/triage.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: ci/cpu-frameworks.sh OUT [TIME] [SEED]}
time=${2:-5m}
seed=${3:-1}
mkdir -p "$out"
venv=${SMALLSEQ_FRAMEWORK_VENV:-target/framework-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch numpy safetensors "jax[cpu]"
fi
py=$venv/bin/python
"$py" -c 'import torch, jax; print("torch", torch.__version__, "jax", jax.__version__)' | tee "$out/versions.txt"
echo "== adapters/tests/test_frameworks.py with torch and jax"
"$py" -m unittest discover -s adapters/tests -p test_frameworks.py
bin=${SMALLSEQ_BIN:-target/release/smallseq}
[ -x "$bin" ] || cargo build --release -q
jobs=$(nproc)
dirs=()
for worker in "torch_sdpa.py --kernel flash" "torch_sdpa.py --kernel math" "jax_attention.py --implementation xla"; do
  name=$(echo "$worker" | tr -c 'a-z0-9\n' '-' | sed 's/--*/-/g; s/-$//')
  echo "== $worker: $time, seed $seed"
  # A campaign's failures are triaged below; its own exit status is not the verdict.
  "$bin" fuzz --backend exec --worker "$py adapters/$worker" --time "$time" --seed "$seed" \
    --jobs "$jobs" --force --out "$out/$name" > "$out/$name.log" 2>&1 || true
  tail -n 2 "$out/$name.log"
  [ -f "$out/$name/report.json" ] && dirs+=("$out/$name")
done
[ ${#dirs[@]} -gt 0 ] || { echo "FAIL: no campaign wrote a report"; exit 1; }
echo "== triage"
# The gate below reads triage.json; triage's own exit status is not the verdict either.
SMALLSEQ_PYTHON=$py "$bin" triage "${dirs[@]}" --out "$out/triage" --shrink-time 20s \
  > "$out/triage.log" 2>&1 || true
tail -n 12 "$out/triage.log"
[ -f "$out/triage/triage.json" ] || { echo "FAIL: triage wrote no triage.json"; exit 1; }
python3 - "$out/triage/triage.json" <<'EOF'
import json, sys
groups = json.load(open(sys.argv[1]))["groups"]
verdict = lambda g: (g.get("finding") or {}).get("verdict", "not_triaged")
bad = [g for g in groups if verdict(g) != "design_or_range_limit"]
print(f"{len(groups)} group(s), {len(bad)} not a characterised limit")
for g in bad:
    print(f"  {verdict(g)}: {g['count']} failure(s), {g['representative']}, script {g['script']}")
sys.exit(1 if bad else 0)
EOF
