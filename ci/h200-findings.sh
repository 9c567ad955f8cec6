#!/usr/bin/env bash
# Runs the standalone scripts of adapters/findings/ on the device (torch and jax there; no
# smallseq needed) and says which reproduce: exit 1 of a script = reproduced, 0 = not, 2 =
# refused, 3 = the script failed (adapters/standalone.py). The capsules of
# adapters/findings/pending/pending.txt and confirmed/confirmed.txt get their script written
# first; a pending finding moves to confirmed/ (and into adapters/FINDINGS.md as a confirmed
# defect) only once its script reproduces on its own.
#   [SMALLSEQ_BIN=smallseq] ci/h200-findings.sh OUT
#                               writes OUT/findings.txt, each script and its output
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: ci/h200-findings.sh OUT}
mkdir -p "$out"
for list in adapters/findings/pending/pending.txt adapters/findings/confirmed/confirmed.txt; do
  grep -v '^#' "$list" | while read -r capsule adapter flags; do
    [ -n "$capsule" ] || continue
    path=$(dirname "$list")/$capsule
    # A script judges with the threshold its capsule recorded; where this build's judge passes
    # the recorded outputs (SMALLSEQ_BIN: a smallseq binary, no GPU needed), the old verdict
    # was the harness's and the script proves nothing against the implementation.
    if [ -n "${SMALLSEQ_BIN:-}" ]; then
      "$SMALLSEQ_BIN" repro "$path" > /dev/null 2>&1
      [ $? = 0 ] && echo "${capsule%.safetensors}: this build's judge passes its recorded outputs" |
        tee -a "$out/findings.txt"
    fi
    # shellcheck disable=SC2086  # the adapter's flags are words
    python3 adapters/standalone.py "$path" --adapter "$adapter" $flags \
      -o "$out/${capsule%.safetensors}.py" > /dev/null 2>&1 ||
      echo "${capsule%.safetensors}: no script written" | tee -a "$out/findings.txt"
  done
done
scripts=()
for s in adapters/findings/*.py "$out"/*.py; do [ -e "$s" ] && scripts+=("$s"); done
# The shipped scripts' outputs land beside them: copy them into OUT first.
mkdir -p "$out/shipped"
for i in "${!scripts[@]}"; do
  case ${scripts[$i]} in adapters/*) cp "${scripts[$i]}" "$out/shipped/" && scripts[$i]=$out/shipped/$(basename "${scripts[$i]}") ;; esac
done
ci/run-scripts.sh "$out/results.txt" "${scripts[@]}" | tee -a "$out/findings.txt"
