#!/usr/bin/env bash
# The Python the adapter kit, `smallseq triage`'s scripts and their tests run under: a venv in
# target/adapters-venv with numpy and safetensors, created when missing (a CI machine's python3
# may have neither). Prints the venv's python on stdout, its progress on stderr.
#
#   py=$(ci/python-kit.sh)     exit 2 when the venv cannot be made
set -uo pipefail
cd "$(dirname "$0")/.."
venv=target/adapters-venv
py=$venv/bin/python
if [ ! -x "$py" ] || ! "$py" -c 'import numpy, safetensors' 2> /dev/null; then
  echo "== venv ($venv: numpy, safetensors)" >&2
  start=$(date +%s)
  { python3 -m venv "$venv" && "$py" -m pip install -q numpy safetensors; } >&2 ||
    { echo "python-kit: venv setup failed" >&2; exit 2; }
  echo "venv created in $(( $(date +%s) - start )) s" >&2
fi
echo "$PWD/$py"
