set -u
bin=$1 out=$2
log=$out/log.txt
say() { echo "$*" | tee -a "$log"; }
export SMALLSEQ_KERNEL_CACHE=/tmp/smallseq-kcache
pgrep -af "fuzz --backend cuda --time" | head -2
timeout 150 "$bin" calibrate --backend cuda --cases 1500 --seed 1 --out "$out/calibrate.json" >/tmp/calibrate.log 2>&1
say "calibrate: exit $?"; tail -22 /tmp/calibrate.log | tee -a "$log"
for i in $(seq 1 30); do pgrep -f "fuzz --backend cuda --time" >/dev/null || break; sleep 5; done
say "$(grep -m1 'cases in' /tmp/fuzz-long.log)"
grep -E '^  [a-z_]+ +pass' /tmp/fuzz-long.log | tee -a "$log"
grep '^FAIL' /tmp/fuzz-long.log | cut -c1-300 | head -12 | tee -a "$log"
cp /tmp/fuzz-long/report.json "$out/fuzz-long-report.json"
tar czf "$out/fuzz-long.tar.gz" -C /tmp fuzz-long fuzz-long.log 2>/dev/null
cp /tmp/smoke.log "$out/smoke.log" 2>/dev/null
tar czf "$out/adapters.tar.gz" -C /tmp ad 2>/dev/null
ls -la $out
