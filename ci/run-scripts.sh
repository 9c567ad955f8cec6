#!/usr/bin/env bash
# Runs standalone scripts (adapters/standalone.py's, adapters/findings/'s) side by side and says
# which reproduce, one line each, sorted: `NAME: reproduced|not reproduced|refused|script
# failed (RC)`. Exit codes are standalone.py's: 1 reproduced, 0 not, 2 refused, 3 the script
# failed; 124 is the timeout. Each script's output goes to NAME.txt beside it.
#   ci/run-scripts.sh RESULTS SCRIPT...     (SCRIPT_LIMIT seconds each, default 120; SCRIPT_JOBS, 6)
set -u
results=${1:?usage: ci/run-scripts.sh RESULTS SCRIPT...}
shift
# A path that is not a file is named as such, not run (a glob that matched nothing reads as
# "refused" otherwise: python3 exits 2 on a missing file).
present=()
for s in "$@"; do
  if [ -f "$s" ]; then present+=("$s"); else echo "$(basename "$s" .py): no such script" >&2; fi
done
set -- "${present[@]}"
[ $# -gt 0 ] || { : > "$results"; exit 0; }
one() {
  local s=$1 rc what
  timeout -k 5 "${SCRIPT_LIMIT:-120}" python3 "$s" > "${s%.py}.txt" 2>&1
  rc=$?
  case $rc in
    1) what=reproduced ;; 0) what="not reproduced" ;; 2) what=refused ;;
    124) what="timed out" ;; *) what="script failed ($rc)" ;;
  esac
  echo "$(basename "$s" .py): $what"
}
export -f one
printf '%s\0' "$@" | xargs -0 -r -P "${SCRIPT_JOBS:-6}" -I{} bash -c 'one "$1"' _ {} | sort > "$results"
cat "$results"
