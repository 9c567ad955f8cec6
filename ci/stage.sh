# Sourced by the CI scripts: `stage NAME CMD...` prints a header, runs CMD, prints its time and
# appends "NAME SECONDS cpu CPU_SECONDS" to $SMALLSEQ_STAGES (target/l0/stages.txt by default),
# so `.ci/run` can print one table of where the time went. CPU_SECONDS is the user and system
# time of CMD and its children: on a machine shared with other work it says what the stage
# cost where the wall-clock time also says how busy the machine was.
: "${SMALLSEQ_STAGES:=target/l0/stages.txt}"
export SMALLSEQ_STAGES
mkdir -p "$(dirname "$SMALLSEQ_STAGES")"
# Sets CHILDREN_CPU to the user plus system seconds of this shell's waited-for children so far
# (bash's `times`, which must run in this shell: a subshell would count its own children only).
children_cpu() {
  local f
  f=$(mktemp)
  times > "$f"
  CHILDREN_CPU=$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] }
                                printf "%d\n", s }' "$f")
  rm -f "$f"
}
stage() {
  local name=$1 t0 c0 rc
  shift
  echo "== $name"
  t0=$(date +%s)
  children_cpu
  c0=$CHILDREN_CPU
  "$@" && rc=0 || rc=$?
  children_cpu
  printf '%s %d cpu %d%s\n' "$name" "$(($(date +%s) - t0))" "$((CHILDREN_CPU - c0))" \
    "$([ "$rc" -eq 0 ] || echo " FAILED")" >> "$SMALLSEQ_STAGES"
  echo "-- $name: $(($(date +%s) - t0)) s$([ "$rc" -eq 0 ] || echo ", FAILED (exit $rc)")"
  return "$rc"
}
