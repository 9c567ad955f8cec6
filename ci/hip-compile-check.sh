#!/usr/bin/env bash
# HIP / gfx942 compile check (no AMD GPU needed). What it proves:
#   1. every kernel file in kernels/ compiles for gfx942 (and gfx950 where this clang knows
#      it; gfx90a on request, see below) into a code object, with the flags the build uses
#      (kernels/hip.flags);
#   2. every kernel the HIP backend launches is in the right code object, taking the arguments
#      the launch passes (pointer or value, and size, from the code object's metadata) and
#      built for the 256-thread blocks it is launched with;
#   3. the small-seq kernels run on the matrix cores: v_mfma in each one's disassembly;
#   4. `cargo build --release --features hip` links against Debian's libamdhip64, embedding the
#      code objects of step 1, and the binary exits 2 with one line when there is no GPU;
#   5. the host model of a gfx942 wavefront (tests/hip_lane_model.rs) passes.
# It installs Debian's clang-19, lld-19, llvm-19 and libamdhip64-dev when they are missing.
# Under `.ci/run`: SMALLSEQ_HIP_OBJECTS_BUILT=1 (step 1 ran in its `cargo test`: build.rs
# compiled the objects it embeds and exported them to target/hip-co, SMALLSEQ_HIP_EXPORT),
# SMALLSEQ_HIP_BINARIES_BUILT=1 (its `cargo test`, with the hip feature, built the binary and
# the example of step 4a), SMALLSEQ_HIP_MODEL_RAN=1 (step 5 ran in that `cargo test`) and
# SMALLSEQ_BACKEND_TESTS_RAN=1 (so did the backend's unit tests) skip what already ran.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
out=target/hip-co

# -- 1. code objects (ci/hip-code-objects.sh, which installs the packages; `.ci/run` has built
# them already) -------------------------------------------------------------------------------
if [ "${SMALLSEQ_HIP_OBJECTS_BUILT:-}" = 1 ]; then
  echo "== code objects: built by this run's cargo test (build.rs, flags: $(cat kernels/hip.flags))"
  for f in "$out"/*.hsaco; do printf '   %-28s %8d bytes\n' "$(basename "$f")" "$(stat -c %s "$f")"; done
else
  ci/hip-code-objects.sh
fi
OBJDUMP=llvm-objdump-19
READELF=llvm-readelf-19
read -r -a archs < "$out/archs"
stems=()
for f in kernels/*.cu; do stems+=("$(basename "$f" .cu)"); done

# -- 4a. build and link (embeds the objects of step 1) -----------------------------------------
export HIP_PATH=${HIP_PATH:-/usr}
arch_list=$(IFS=,; echo "${archs[*]}")
if [ "${SMALLSEQ_HIP_BINARIES_BUILT:-}" = 1 ]; then
  # `.ci/run`'s `cargo test` built both, with the cuda and hip features, on these objects.
  echo "== build: target/release/smallseq and examples/hip_kernel_names from this run's cargo test"
else
  SMALLSEQ_HIP_PREBUILT=$PWD/$out SMALLSEQ_HIP_ARCHS=$arch_list \
    cargo build -q --release --features hip --bin smallseq --example hip_kernel_names
fi
# The backend's own unit tests (kernel names, launch lists) need the feature, hence here (under
# `.ci/run` they ran already, in its cargo test with both features).
if [ "${SMALLSEQ_BACKEND_TESTS_RAN:-}" = 1 ]; then
  echo "== backend unit tests (hip): ran in this run's cargo test (features cuda,hip)"
else
  ci/backend-unit-tests.sh hip
fi
bin=target/release/smallseq
lib=$(ldd "$bin" | awk '/libamdhip64/ {print $3}')
[ -n "$lib" ] || { echo "FAIL: $bin is not linked against libamdhip64" >&2; exit 1; }
echo "== link: $bin -> $lib ($(dpkg-query -W -f='${Package} ${Version}' libamdhip64-5 2>/dev/null || echo '?'))"

# -- 2, 3. symbols and matrix cores ------------------------------------------------------------
target/release/examples/hip_kernel_names > "$out/kernels.txt"
fail=0
for a in "${archs[@]}"; do
  for s in "${stems[@]}"; do
    # One line per kernel: name, explicit arguments (P pointer, else bytes by value), and the
    # largest block it was built for. Metadata keys are sorted, so .args come before .name.
    $READELF --notes "$out/$s.$a.hsaco" | awk '
      /^  - / { sig = ""; inarg = 0 }
      /^      - / { inarg = 1 }
      /^    \.[a-z_]+:/ { inarg = 0 }
      inarg && /\.size:/ { size = $NF }
      inarg && /\.value_kind:/ { if ($NF == "global_buffer") sig = sig "P"; else if ($NF == "by_value") sig = sig size }
      /^    \.max_flat_workgroup_size:/ { mwg = $NF }
      /^    \.name:/ { print $NF, sig, mwg }' > "$out/$s.$a.syms"
    $OBJDUMP -d --no-show-raw-insn "$out/$s.$a.hsaco" > "$out/$s.$a.s"
  done
  missing=0 mismatched=0
  while read -r stem name args; do
    read -r _ got mwg <<< "$(grep "^$name " "$out/$stem.$a.syms" || true)"
    if [ -z "${got:-}" ] && [ -z "${mwg:-}" ]; then
      echo "FAIL: $a: $name missing from $stem.$a.hsaco"; missing=$((missing + 1))
    elif [ "$got" != "$args" ] || [ "$mwg" -lt 256 ]; then
      echo "FAIL: $a: $name takes ($got) and blocks of up to $mwg; the backend passes ($args) with 256 threads"
      mismatched=$((mismatched + 1))
    fi
    got="" mwg=""
  done < "$out/kernels.txt"
  echo "== $a: $(wc -l < "$out/kernels.txt") launched kernels: $missing missing, $mismatched with other arguments than the launch passes"
  [ "$missing" -eq 0 ] && [ "$mismatched" -eq 0 ] || fail=1
  # v_mfma per small-seq kernel (static count in its disassembly).
  awk '/^[0-9a-f]+ <[A-Za-z_0-9]+>:$/ {f = substr($2, 2, length($2) - 3)}
       /v_mfma_/ {n[f]++; m[$1]++}
       END {for (k in n) printf "   %-34s %4d v_mfma\n", k, n[k];
            for (k in m) printf "   mnemonic %s: %d\n", k, m[k] > "/dev/stderr"}' \
    "$out/small_seq.$a.s" 2> "$out/mnemonics.$a.txt" | sort > "$out/mfma.$a.txt"
  cat "$out/mfma.$a.txt" "$out/mnemonics.$a.txt"
  while read -r stem name _; do
    [ "$stem" = small_seq ] || continue
    grep -q "^   $name " "$out/mfma.$a.txt" || { echo "FAIL: $a: $name has no v_mfma"; fail=1; }
  done < "$out/kernels.txt"
  # Scratch (spills) would still be correct, only slow: reported, not gated.
  spills=$($READELF --notes "$out/small_seq.$a.hsaco" | awk '/\.vgpr_spill_count:/ {s += $2} END {print s + 0}')
  echo "   small_seq.$a: VGPR spills over all kernels: $spills"
done
[ "$fail" -eq 0 ] || exit 1

# -- 4b. no device: exit 2, one line -----------------------------------------------------------
set +e
err=$("$bin" fuzz --backend hip --cases 1 --force --out "$out/fuzz" 2>&1 >/dev/null)
rc=$?
set -e
if [ -e /dev/kfd ]; then
  # An AMD GPU is present: the one-case campaign ran, and only a pass is a pass (1 is a
  # property failure, 2 a device the binary could not open, anything else a crash).
  echo "== smallseq fuzz --backend hip (AMD GPU present): exit $rc"
  if [ "$rc" -ne 0 ]; then
    printf '%s\n' "$err" | tail -20
    echo "FAIL: the device campaign exited $rc (0 expected with /dev/kfd)" >&2; exit 1
  fi
else
  echo "== smallseq fuzz --backend hip (no GPU here): exit $rc: $err"
  [ "$rc" -eq 2 ] || { echo "FAIL: expected exit 2 without a GPU" >&2; exit 1; }
  [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] || { echo "FAIL: more than one line" >&2; exit 1; }
fi

# -- 5. host model of the wavefront (in `.ci/run`, its `cargo test` ran it already) -----------
if [ "${SMALLSEQ_HIP_MODEL_RAN:-}" = 1 ]; then
  echo "== hip model: ran in this run's cargo test (SMALLSEQ_HIP_MODEL_RAN=1)"
elif ! log=$(SMALLSEQ_HIP_CLANG=clang++-19 SMALLSEQ_REQUIRE_HIP_MODEL=1 \
  cargo test -q --release --test hip_lane_model -- --nocapture 2>&1); then
  printf '%s\n' "$log"; echo "FAIL: hip wavefront model" >&2; exit 1
else
  printf '%s\n' "$log" | grep -E "^FAIL|[0-9]+ passed, [0-9]+ failed" | sed 's/^/== hip model: /'
fi
echo "== hip-compile-check passed in $(($(date +%s) - t0)) s"
