#!/usr/bin/env bash
# Step 1 of the HIP / gfx942 compile check (ci/hip-compile-check.sh): every kernel file in
# kernels/ compiled for gfx942 (and gfx950 where this clang knows it; SMALLSEQ_HIP_ARCHS adds
# gfx90a) into target/hip-co/<stem>.<arch>.hsaco with kernels/hip.flags, one clang per file and
# arch, side by side. Writes the archs it built to target/hip-co/archs. `.ci/run` starts it in
# the background while cargo builds and tests.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
out=target/hip-co
mkdir -p "$out"
ci/hip-packages.sh
CLANG=clang-19
read -r -a FLAGS < kernels/hip.flags
echo "== $($CLANG --version | head -1); flags: ${FLAGS[*]}"

knows() { echo 'extern "C" __attribute__((global)) void k() {}' |
  $CLANG "${FLAGS[@]}" --offload-arch="$1" -o /dev/null - >/dev/null 2>&1; }
# gfx942 always; the others where this clang knows them. gfx90a is left out by default: it
# takes the same source paths as gfx942 (the same MFMA branch of portable.h) and would double
# the compile time, the bulk of this check (SMALLSEQ_HIP_ARCHS=gfx942,gfx90a,gfx950 adds it).
archs=()
IFS=, read -r -a want <<< "${SMALLSEQ_HIP_ARCHS:-gfx942,gfx950}"
[[ " ${want[*]} " == *" gfx942 "* ]] || want=(gfx942 "${want[@]}")
for a in "${want[@]}"; do
  if knows "$a"; then archs+=("$a"); else
    [ "$a" = gfx942 ] && { echo "FAIL: $CLANG cannot target gfx942" >&2; exit 1; }
    echo "   $a: skipped ($CLANG does not know this processor)"
  fi
done
stems=()
for f in kernels/*.cu; do stems+=("$(basename "$f" .cu)"); done
pids=()
for a in "${archs[@]}"; do
  for s in "${stems[@]}"; do
    ( $CLANG "${FLAGS[@]}" --offload-arch="$a" -o "$out/$s.$a.hsaco" "kernels/$s.cu" \
        2> "$out/$s.$a.log" || { echo "FAIL: kernels/$s.cu for $a:"; cat "$out/$s.$a.log"; exit 1; } ) &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
for a in "${archs[@]}"; do for s in "${stems[@]}"; do
  printf '   %-28s %8d bytes\n' "$s.$a.hsaco" "$(stat -c %s "$out/$s.$a.hsaco")"
done; done
t1=$(date +%s); echo "== compiled ${#stems[@]} files x ${#archs[@]} archs in $((t1 - t0)) s"

echo "${archs[*]}" > "$out/archs"
