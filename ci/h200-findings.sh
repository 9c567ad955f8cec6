#!/usr/bin/env bash
# Runs every standalone script of adapters/findings/ on the device (torch and jax there; no
# smallseq needed) and says which reproduce: exit 1 of a script = reproduced, 0 = not, 2 =
# refused, 3 = the script failed (adapters/standalone.py). A pending finding (findings/pending/)
# moves up into FINDINGS.md as a confirmed defect only once its script reproduces alone.
#   ci/h200-findings.sh OUT     writes OUT/findings.txt and each script's output
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: ci/h200-findings.sh OUT}
mkdir -p "$out"
for s in adapters/findings/*.py adapters/findings/pending/*.py; do
  [ -e "$s" ] || continue
  name=$(basename "$s" .py)
  timeout -k 5 120 python3 "$s" > "$out/$name.txt" 2>&1
  rc=$?
  case $rc in 1) what=reproduced ;; 0) what="not reproduced" ;; 2) what=refused ;; *) what="script failed ($rc)" ;; esac
  echo "$name: $what" | tee -a "$out/findings.txt"
done
