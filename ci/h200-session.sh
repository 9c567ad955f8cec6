#!/usr/bin/env bash
# GPU work for one call of the `device` tool (an H200): correctness tests, the conformance
# calibration, the benchmark with the PyTorch peers timed in the same run, ncu's register and
# occupancy figures, compute-sanitizer, the kernel mutants and a fuzz campaign. Every stage has
# its own time limit, so the whole call ends inside the tool's 10 minutes.
#
#   ci/h200-session.sh BIN_DIR OUT_DIR FUZZ_TIME [STAGE ...]
#
# BIN_DIR holds `smallseq` (built with --features cuda), `cuda_backend` (the test binary of
# tests/cuda_backend.rs) and `backends` (proptests/tests/backends.rs with --features cuda), and
# may hold kernel-cache.tar.xz (below).
# Stages, in the order given: tests calibrate bench variants fbvariants ncu ncubwd ncusource
# stalls sanitize sancases mutants fuzz fuzzbg fuzzwait (default: tests calibrate bench ncu sanitize
# mutants fuzz; VARIANTS lists the
# variants, VARIANT_FIX512=0 leaves out the 512-token fallback there and VARIANT_FILTER narrows
# its small-seq workloads (bench --filter; fix16,rnd,q1 by default); FUZZ_SEED the campaign's
# seed, 2027 by default; FUZZ_VARIANTS the campaigns `fuzzbg` starts side by side, one per
# variant, `default` for the shipped build, `seed=N` in a variant for its own seed). Results go
# to OUT_DIR (log.txt, bench.json, peers.json, calibrate.json, ncu-stalls.txt, fuzz-report.json,
# fuzz-summary.md, capsules.tar.gz, proptest-capsules.tar.gz; the Nth further campaign's fuzz
# files end in -N): at most 8 files per call, the tool's limit. REQUIRE_CARD (a part of the
# card's name, H200) runs the stages only on that card.
set -u
bin=$1 out=$2 fuzz_time=$3
shift 3
stages=${*:-tests calibrate bench ncu sanitize mutants fuzz}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
log=$out/log.txt
ss=$bin/smallseq
# Compiled kernels: BIN_DIR/kernel-cache.tar.xz, when there, holds cache entries filled without a
# GPU (examples/fill_kernel_cache.rs, the same NVRTC major.minor), one pair per variant, so no
# stage waits for NVRTC (about two minutes per variant here).
export SMALLSEQ_KERNEL_CACHE=${SMALLSEQ_KERNEL_CACHE:-/tmp/smallseq-kcache}
mkdir -p "$SMALLSEQ_KERNEL_CACHE"
[ -f "$bin/kernel-cache.tar.xz" ] && tar xJf "$bin/kernel-cache.tar.xz" -C "$SMALLSEQ_KERNEL_CACHE" &&
  echo "kernel cache: $(ls "$SMALLSEQ_KERNEL_CACHE" | wc -l) entries from $bin/kernel-cache.tar.xz" | tee -a "$log"
# The whole script stops inside SESSION_LIMIT seconds (default 560): each command's limit is
# cut to what is left, and a command with under 15 s left is skipped.
deadline=$((SECONDS + ${SESSION_LIMIT:-560}))
run() { # limit, command...
  local limit=$1 left=$((deadline - SECONDS))
  shift
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "SKIP (session time): $*" | tee -a "$log"
    return
  fi
  echo "\$ $*" | tee -a "$log"
  # -k: `fuzz` finishes its case on SIGTERM (to write its report); a hung case is killed.
  timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$log" | tail -40
  echo "-> exit ${PIPESTATUS[0]}" | tee -a "$log"
}
# The campaign of the fuzz stages, and what of it comes back.
fuzz_args=(fuzz --backend cuda --shrink-time 3s)
secs() { # 2h, 1.5m, 300s or 300 -> whole seconds (the fuzz CLI's duration forms)
  awk -v d="$1" 'BEGIN { u = substr(d, length(d)); m = u == "h" ? 3600 : u == "m" ? 60 : 1
                         printf "%d\n", (d + 0) * m }'
}
collect_fuzz() { # [SUFFIX]: the campaign in /tmp/fuzzSUFFIX
  local d=/tmp/fuzz${1:-}
  cp "$d/report.json" "$out/fuzz-report${1:-}.json" 2>/dev/null
  cp "$d/summary.md" "$out/fuzz-summary${1:-}.md" 2>/dev/null
  # The tool brings back files of at most 16 MiB: every shrunk capsule and the report first,
  # then whole capsules while the archive stays under 15 MiB (seed 2091's 61 full capsules
  # came to more, and none came back).
  local list=/tmp/capsule-list${1:-}
  (cd "$d" && { ls report.json summary.md capsules/*-shrunk.safetensors 2>/dev/null
                ls capsules/*.safetensors 2>/dev/null | grep -v -- '-shrunk'; }) > "$list"
  local n
  n=$(wc -l < "$list")
  while [ "$n" -gt 0 ]; do
    tar czf "$out/capsules${1:-}.tar.gz" -C "$d" $(head -n "$n" "$list") 2>/dev/null
    [ "$(stat -c %s "$out/capsules${1:-}.tar.gz")" -lt 15728640 ] && break
    n=$((n * 3 / 4))
  done
}
. "$(dirname "$0")/variants.sh"  # split_variant
# `run` under the current variant's environment and kernel defines (after split_variant).
vrun() { run "$1" env "${envs[@]}" SMALLSEQ_KERNEL_DEFINES="${defs[*]}" "${@:2}"; }
# Calls FUNCTION once per variant, the default build first (VARIANTS lists the others).
each_variant() { # FUNCTION
  local v
  for v in default ${VARIANTS:-}; do
    echo "-- variant: $v" | tee -a "$log"
    split_variant "$v"
    "$1"
  done
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$log"
# REQUIRE_CARD=H200: stop before any stage on another card. A call that asks for an H200 may
# get an H100, and a table meant for the H200 would then spend the budget on a second H100's.
if [ -n "${REQUIRE_CARD:-}" ]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case $card in
    *"$REQUIRE_CARD"*) ;;
    *) echo "REQUIRE_CARD=$REQUIRE_CARD: this machine's card is ${card:-unknown}; no stage run" | tee -a "$log"
       exit 0 ;;
  esac
fi
for s in $stages; do
  echo "== $s $(date +%T)" | tee -a "$log"
  case $s in
    tests)
      SMALLSEQ_REQUIRE_GPU=1 run 150 "$bin/cuda_backend" --test-threads 1
      SMALLSEQ_REQUIRE_GPU=1 run 150 "$bin/backends"
      # Capsules of failing property cases (the path is compiled into the test binary).
      caps=$(find / -path /proc -prune -o -type d -name proptest-capsules -print 2>/dev/null | head -1)
      [ -n "$caps" ] && tar czf "$out/proptest-capsules.tar.gz" -C "$caps" . ;;
    calibrate)
      run 120 "$ss" calibrate --backend cuda --cases 3000 --seed 1 --out "$out/calibrate.json" ;;
    bench)
      run 150 "$ss" bench --backend cuda --out "$out/bench.json" ${BENCH_ARGS:-}
      # JAX's start and compiles take most of a minute (bench/peers_jax.py, its own process).
      # W1-W3 took about 200 s (v13); aten._cudnn_attention_forward on W4 finished no call in
      # 300 s (v11, v13) and held back every W4 and 512-token peer after it, so it is skipped
      # there by default (PEERS_ARGS replaces that; PEERS_ARGS= times it), and the limit is PEERS_LIMIT (420 s).
      [ "${PEERS:-1}" = 1 ] && run "${PEERS_LIMIT:-420}" python3 bench/peers.py "$out/bench.json" \
        ${PEERS_ARGS---skip q1/cudnn_varlen} ;;
    variants)
      # Kernel variants timed back to back with the default build, the 512-token fallback
      # forward and the small-seq workloads' forward and backward.
      small_seq_times() {
        vrun 90 "$ss" bench --backend cuda --iters 20 --fallback false \
          --filter "${VARIANT_FILTER:-fix16,rnd,q1}"
        [ "${VARIANT_FIX512:-1}" = 1 ] && vrun 40 "$ss" bench --backend cuda --iters 20 \
          --forward-only --filter fix512
      }
      each_variant small_seq_times ;;
    ncu)
      run 120 ncu --clock-control none --kernel-name regex:'small_seq_fwd|small_seq_bwd|fallback_fwd_tc' \
        --launch-count 6 --metrics launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        "$ss" bench --backend cuda --iters 1 --warmup 0 --rotate-mb 1 --filter fix ;;
    stalls)
      # Where the small-seq kernels' warps wait, on the ragged workloads (W2 `rnd1-17_h16`, W4
      # `q1`; the backward's setup runs the forward again): ncu's sections and every stall
      # reason's cycles per issued instruction, into ncu-stalls.txt. STALL_KERNELS (a regex),
      # STALL_FILTER (bench --filter) and STALL_FALLBACK (bench --fallback) point it at other
      # kernels: the tiled fallback backward on 512-token slots is
      # STALL_KERNELS='fallback_bwd_(q|kv)_tc' STALL_FILTER=fix512 STALL_FALLBACK=true.
      left=$((deadline - SECONDS))
      [ "$left" -gt 200 ] && left=200
      if [ "$left" -lt 15 ]; then
        echo "SKIP (session time): stalls" | tee -a "$log"
        continue
      fi
      echo "\$ ncu (stalls, ${left} s) > ncu-stalls.txt" | tee -a "$log"
      timeout -k 20 "$left" ncu --clock-control none \
        --kernel-name regex:"${STALL_KERNELS:-small_seq_fwd|small_seq_bwd}" \
        --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
        --section SchedulerStats --section Occupancy \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        "$ss" bench --backend cuda --iters 1 --warmup 0 --rotate-mb 1 \
        --fallback "${STALL_FALLBACK:-false}" --filter "${STALL_FILTER:-rnd1-17_h16,q1}" \
        > "$out/ncu-stalls.txt" 2>&1
      echo "-> exit $?" | tee -a "$log" ;;
    ncusource)
      # Where the small-seq forward's instructions go on W4 (one query per slot; 1,772 warp
      # instructions per item in v14): instructions executed and stall samples per SASS
      # instruction and source line (-lineinfo), per variant, into ncu-source[-VARIANT].csv, and
      # the whole report (ncu-source.ncu-rep, default build) for the Nsight Compute GUI.
      # SOURCE_KERNELS (a regex), SOURCE_LAUNCHES, SOURCE_FILTER and SOURCE_FALLBACK point it at
      # other kernels, as STALL_* do for `stalls`.
      source_profile() {
        local tag
        tag=$(echo "${defs[*]}" | tr -c 'A-Za-z0-9_=\n' _ | tr '=' '-')
        vrun 150 ncu --clock-control none --kernel-name regex:"${SOURCE_KERNELS:-small_seq_fwd}" \
          --launch-count "${SOURCE_LAUNCHES:-1}" \
          --section SourceCounters --section InstructionStats --import-source yes \
          -o "/tmp/ncu-source$tag" -f "$ss" bench --backend cuda --iters 1 --warmup 0 \
          --rotate-mb 1 --fallback "${SOURCE_FALLBACK:-false}" --filter "${SOURCE_FILTER:-q1}"
        run 60 sh -c "ncu -i /tmp/ncu-source$tag.ncu-rep --page source --csv --print-source sass > '$out/ncu-source${tag:+-$tag}.csv'"
        [ -z "$tag" ] && cp /tmp/ncu-source.ncu-rep "$out/" 2>/dev/null
      }
      each_variant source_profile ;;
    fbvariants)
      # The fallback's kernels (forward and backward) timed per variant, back to back with the
      # default build: 512-token slots and W3 (D = 256), or the workloads of FB_FILTER.
      fallback_times() {
        vrun 120 "$ss" bench --backend cuda --iters 20 --filter "${FB_FILTER:-fix512,rnd1-17_h32}"
      }
      each_variant fallback_times ;;
    ncubwd)
      # The tiled fallback backward's limits on 512-token slots and W3: registers, occupancy,
      # tensor pipe, shared-memory wavefronts and bank conflicts, the main stalls; per variant.
      bwd_profile() {
        vrun 150 ncu --clock-control none \
          --kernel-name regex:'fallback_bwd_(q|kv)_tc' --launch-count 4 --metrics \
launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,\
gpu__time_duration.sum \
          "$ss" bench --backend cuda --iters 1 --warmup 0 --rotate-mb 1 --filter fix512,rnd1-17_h32
      }
      each_variant bwd_profile ;;
    sancases)
      # compute-sanitizer on small cases of the tiled backward (its bench workloads take minutes
      # a launch under racecheck): D = 256 (the dV/dK split), GQA and causal; D = 128 and 64
      # (swizzled tiles), two slots, a window, more than one key tile; and of the small-seq
      # kernels.
      mk() { "$ss" case new --out "/tmp/$1.safetensors" "${@:2}" > /dev/null || echo "case new $1 failed" | tee -a "$log"; }
      mk sc256 --dtype bf16 --heads 2 --kv-heads 1 --head-dim 256 --q-lens 20,33 --kv-lens 24,40 --mask causal
      mk sc128 --dtype f16 --heads 2 --kv-heads 1 --head-dim 128 --q-lens 40,3 --kv-lens 70,5
      mk sc64 --dtype bf16 --heads 1 --head-dim 64 --q-lens 70 --kv-lens 90 --window=8,3
      # The small-seq kernels' one-query items (SS_ONE_QUERY) at each head dim, 17-key slots
      # and one-key slots among them.
      mk sq256 --dtype f16 --heads 2 --kv-heads 1 --head-dim 256 --q-lens 1,1,2 --kv-lens 17,3,5
      mk sq128 --dtype bf16 --heads 2 --head-dim 128 --q-lens 1,1,1,4 --kv-lens 16,2,1,7 --mask causal
      mk sq64 --dtype f16 --heads 1 --head-dim 64 --q-lens 1,1 --kv-lens 9,17
      for c in sc256 sc128 sc64 sq256 sq128 sq64; do
        for tool in racecheck memcheck; do
          run 90 compute-sanitizer --tool $tool --error-exitcode 1 "$ss" run --backend cuda \
            --case "/tmp/$c.safetensors" --out "/tmp/$c-$tool.safetensors"
        done
      done ;;
    sanitize)
      run 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$ss" fuzz --backend cuda --cases 10 --seed 5 --shrink-time 0 --force --out /tmp/san-m
      # The tiled fallback (both directions, 16 and 512 tokens) and the small-seq kernels.
      run 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$ss" bench --backend cuda --iters 1 --warmup 0 --rotate-mb 1 --filter fix512,fix16
      run 150 compute-sanitizer --tool racecheck --error-exitcode 1 "$ss" bench --backend cuda --iters 1 --warmup 0 --rotate-mb 1 --filter fix512,fix16
      run 60 compute-sanitizer --tool racecheck --error-exitcode 1 "$ss" fuzz --backend cuda --cases 6 --seed 6 --shrink-time 0 --force --out /tmp/san-r ;;
    mutants)
      run 150 "$ss" mutants --backend cuda --cases 150 --seed 1 ;;
    fuzzbg)
      # The fuzz campaigns in their own process sessions, so they outlive this call (the device
      # tool ends a call's processes, not a new session's): `fuzzwait` in the next call, within
      # the machine's idle time, collects them. For campaigns longer than one call allows.
      rm -rf /tmp/fuzz /tmp/fuzz-* /tmp/fuzz.pid /tmp/fuzz*.pid
      i=0
      for v in ${FUZZ_VARIANTS:-default}; do
        sfx=$([ $i -gt 0 ] && echo "-$i")
        split_variant "$v"
        args=("${fuzz_args[@]}" --seed "${seed:-${FUZZ_SEED:-2027}}" --force --out "/tmp/fuzz$sfx")
        echo "\$ setsid env ${envs[*]} SMALLSEQ_KERNEL_DEFINES='${defs[*]}' $ss ${args[*]} --time $fuzz_time" | tee -a "$log"
        # The campaign writes its own pid (setsid forks when the shell leads a process group).
        setsid sh -c 'echo $$ > "$0"; exec "$@"' "/tmp/fuzz$sfx.pid" env "${envs[@]}" \
          SMALLSEQ_KERNEL_DEFINES="${defs[*]}" "$ss" "${args[@]}" --time "$fuzz_time" \
          > "/tmp/fuzz$sfx.log" 2>&1 < /dev/null &
        i=$((i + 1))
      done
      sleep 1 ;;
    fuzzwait)
      pids=(/tmp/fuzz*.pid)
      if [ ! -f "${pids[0]}" ]; then
        echo "fuzzwait: no background campaign on this machine (a fresh one?)" | tee -a "$log"
        continue
      fi
      alive() { local f; for f in "${pids[@]}"; do kill -0 "$(cat "$f")" 2>/dev/null && return 0; done; return 1; }
      # Stop 45 s before the deadline: a stopped campaign may take 30 s to write its report, and
      # collecting it must still fit (a wait to the deadline itself ran a call past the tool's
      # limit once, and the machine went back with the report on it: seed 2094).
      while alive && [ $SECONDS -lt $((deadline - 45)) ]; do sleep 5; done
      if alive; then
        # SIGTERM: a campaign finishes its case and writes the report of what ran.
        echo "fuzzwait: campaigns still running at the deadline; stopping them" | tee -a "$log"
        for f in "${pids[@]}"; do kill -TERM "$(cat "$f")" 2>/dev/null; done
        for _ in $(seq 30); do alive || break; sleep 1; done
      fi
      for f in "${pids[@]}"; do
        sfx=${f#/tmp/fuzz}; sfx=${sfx%.pid}
        echo "-- campaign /tmp/fuzz$sfx" | tee -a "$log"
        tail -25 "/tmp/fuzz$sfx.log" | tee -a "$log"
        collect_fuzz "$sfx"
      done ;;
    fuzz)
      # The campaign's own budget ends inside the session's, so it stops by itself and writes
      # its report (one that the limit kills leaves none). Its clock starts once the workers
      # are up: 32 workers loading the kernels on a fresh machine took 47 s (v14, whose 5-minute
      # campaign a 40 s margin cut at 292.5 s).
      t=$(secs "$fuzz_time") left=$((deadline - SECONDS - 100))
      [ "$left" -lt "$t" ] && t=$left
      if [ "$t" -lt 10 ]; then
        echo "SKIP (session time): fuzz" | tee -a "$log"
      else
        run $((t + 90)) "$ss" "${fuzz_args[@]}" --seed "${FUZZ_SEED:-2027}" --force --out /tmp/fuzz \
          --time "${t}s"
      fi
      collect_fuzz ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
  esac
done
echo "== done $(date +%T)" | tee -a "$log"
