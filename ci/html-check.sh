#!/usr/bin/env bash
# Loads report pages in a real headless browser (Debian's chromium) and checks each one:
# it loads (the browser prints its DOM), it logs nothing to the console (the pages have no
# script, so any console line is an error: a resource it tried to fetch, a parse failure),
# it names no outside resource, and the failure count it shows equals the one in the
# report.json beside it.
#
#   ci/html-check.sh RUN_DIR...     each RUN_DIR holds report.json and report.html
#
# Also renders `smallseq report` over all the RUN_DIRs and checks that page, and checks that
# the console check itself can fail (a page that logs an error must be caught).
# Installs chromium with apt-get when it is missing (root, or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "html-check: need root or sudo to install chromium" >&2; exit 1; }
    sudo="sudo"
  fi
  t0=$(date +%s)
  echo "== installing chromium (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
  browser=$(command -v chromium)
  echo "   installed in $(($(date +%s) - t0)) s"
fi
echo "== $("$browser" --version 2>/dev/null | head -1)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# load PAGE NAME: the page's DOM in $work/NAME.dom, the browser's log in $work/NAME.log.
load() {
  timeout 60 "$browser" --headless --no-sandbox --disable-gpu --no-first-run \
    --user-data-dir="$work/profile" --enable-logging=stderr --v=0 \
    --dump-dom "file://$(realpath "$1")" > "$work/$2.dom" 2> "$work/$2.log"
}

# check PAGE EXPECTED_FAILURES NAME: fails (returns 1) with a message on any problem.
check() {
  local page=$1 want=$2 name=$3 bad=0
  if ! load "$page" "$name"; then
    echo "FAIL: $page: the browser did not load it"; tail -5 "$work/$name.log"; return 1
  fi
  grep -q '</html>' "$work/$name.dom" || { echo "FAIL: $page: no DOM came back"; bad=1; }
  if grep -E 'CONSOLE|Uncaught|ERR_FILE_NOT_FOUND|ERR_NAME_NOT_RESOLVED|net::ERR' "$work/$name.log"; then
    echo "FAIL: $page: console errors (above)"; bad=1
  fi
  if grep -Eo '(src|href)="(https?:)?//[^"]*"' "$page"; then
    echo "FAIL: $page: refers to outside resources (above)"; bad=1
  fi
  local shown
  shown=$(grep -o 'id="failure-count">[0-9]*<' "$work/$name.dom" | grep -o '[0-9]*' || true)
  if [ "$shown" != "$want" ]; then
    echo "FAIL: $page: shows ${shown:-no} failure count, its report.json holds $want"; bad=1
  fi
  [ "$bad" -eq 0 ] && echo "   ok: $page ($want failures shown, no console output)"
  return "$bad"
}

t0=$(date +%s)
fail=0 total=0
for dir in "$@"; do
  n=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["failures"]))' "$dir/report.json")
  total=$((total + n))
  check "$dir/report.html" "$n" "run$total-$(basename "$dir")" || fail=1
done
# The caller's binary (SMALLSEQ_BIN: `.ci/run` passes the one its tests built, with their
# features), else the release build.
if [ -n "${SMALLSEQ_BIN:-}" ]; then
  "$SMALLSEQ_BIN" report "$@" --out "$work/trend.html"
else
  cargo run -q --release -- report "$@" --out "$work/trend.html"
fi
check "$work/trend.html" "$total" trend || fail=1

# The check must be able to fail: a page with a script error and a wrong count.
printf '<!DOCTYPE html><html><body><span id="failure-count">7</span><script>undefined_fn()</script></body></html>\n' > "$work/bad.html"
if check "$work/bad.html" 0 control > "$work/control.out"; then
  echo "FAIL: the console check passed a page with a script error"; fail=1
elif ! grep -q "console errors" "$work/control.out" || ! grep -q "shows 7 failure count" "$work/control.out"; then
  cat "$work/control.out"; echo "FAIL: the control page's problems were not both reported"; fail=1
else
  echo "   ok: a page with a script error and a wrong count is refused"
fi
echo "== html-check: $(($# + 2)) pages in $(($(date +%s) - t0)) s: $([ "$fail" -eq 0 ] && echo passed || echo FAILED)"
exit "$fail"
