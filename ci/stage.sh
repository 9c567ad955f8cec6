# Sourced by the CI scripts: `stage NAME CMD...` prints a header, runs CMD, prints its time and
# appends "NAME SECONDS" to $SMALLSEQ_STAGES (target/l0/stages.txt by default), so `.ci/run`
# can print one table of where the time went.
: "${SMALLSEQ_STAGES:=target/l0/stages.txt}"
export SMALLSEQ_STAGES
mkdir -p "$(dirname "$SMALLSEQ_STAGES")"
stage() {
  local name=$1 t0 rc
  shift
  echo "== $name"
  t0=$(date +%s)
  "$@" && rc=0 || rc=$?
  printf '%s %d%s\n' "$name" "$(($(date +%s) - t0))" "$([ "$rc" -eq 0 ] || echo " FAILED")" \
    >> "$SMALLSEQ_STAGES"
  echo "-- $name: $(($(date +%s) - t0)) s$([ "$rc" -eq 0 ] || echo ", FAILED (exit $rc)")"
  return "$rc"
}
