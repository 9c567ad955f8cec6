#!/usr/bin/env bash
# Runs one device script across two calls on one warm machine, for work longer than a call's
# 10 minutes (a 10-minute adapter campaign and its triage): the first call starts it in its own
# process session (the device tool ends a call's processes, not a new session's) and returns
# before the call's limit; the second, made within the machine's idle time (30 s), waits for it
# and brings its outputs home. The script writes into OUT=/tmp/relay/out, copied to $OUT.
#   call 1: ci/device-relay.sh start WAIT_S SCRIPT [ARGS...]   (the environment passes through)
#   call 2: ci/device-relay.sh collect WAIT_S
# Each prints the script's log (OUT/log.txt) at its end. A script that ends within the first
# call's WAIT_S is collected by that call.
set -u
dir=/tmp/relay
mode=${1:?usage: ci/device-relay.sh start WAIT_S SCRIPT [ARGS...] | collect WAIT_S}
wait_s=${2:?the seconds to wait}
shift 2
alive() { [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; }
bring_home() {
  if [ -n "${OUT:-}" ] && [ -d "$dir/out" ]; then cp -r "$dir/out/." "$OUT/"; fi
  cp "$dir/run.log" "${OUT:-/tmp}/relay.log" 2>/dev/null
  tail -200 "$dir/out/log.txt" 2>/dev/null || tail -60 "$dir/run.log"
}
case $mode in
  start)
    [ $# -gt 0 ] || { echo "device-relay: no script to start" >&2; exit 2; }
    alive && { echo "device-relay: a relayed script is still running here (collect it first)" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir/out"
    setsid sh -c 'echo $$ > "$0/pid"; exec env OUT="$0/out" "$@"' "$dir" "$@" \
      > "$dir/run.log" 2>&1 < /dev/null &
    sleep 2
    ;;
  collect)
    [ -f "$dir/pid" ] || { echo "device-relay: nothing was started on this machine (a fresh one?)" >&2; exit 3; }
    ;;
  *) echo "device-relay: unknown mode $mode (start or collect)" >&2; exit 2 ;;
esac
while alive && [ "$SECONDS" -lt "$wait_s" ]; do sleep 3; done
if alive; then
  echo "device-relay: still running after ${SECONDS} s: collect it in the next call, within the machine's idle time"
  tail -5 "$dir/out/log.txt" 2>/dev/null
  [ "$mode" = start ] && exit 0
  echo "device-relay: bringing home what is there; the script goes on until the machine goes back"
  bring_home
  exit 124
fi
echo "device-relay: the script ended ($SECONDS s into this call)"
bring_home
