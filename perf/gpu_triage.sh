#!/usr/bin/env bash
# One GPU device call (~9 min) for the served-pipeline crash (perf/README.md, 2026-12-03), then the bench:
#  1. tools/bls_stress with large host tensors: Triton's default pinned pool, none, and a big one; then
#     responses that carry a host and a GPU tensor (as omni_ensemble's stages send), and calls left at
#     their first response (as omni_ensemble's code2wav() did);
#  2. the served smoke (single W1 requests, bursts of 16 and 64) with the first tritonserver arguments
#     under which bls_stress passed;
#  3. perf/gpu_bench.sh with those arguments if the burst of 16 passed (PERF_TRITON_ARGS).
#
#   source .carry/device/env.sh && bash perf/gpu_triage.sh $OUT
set -u
OUT="${1:?usage: bash perf/gpu_triage.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
chosen="" found=0
for args in "" "--pinned-memory-pool-byte-size=0" "--pinned-memory-pool-byte-size=4294967296"; do
  echo "== bls_stress cpu [$args]" | tee -a "$OUT/triage.log"
  timeout 90 "$PY" tools/bls_stress/run.py --device cpu --concurrency 32 --rounds 6 \
    ${args:+--triton-arg=$args} > "$OUT/stress.log" 2>&1
  rc=$?
  grep -v threading.py "$OUT/stress.log" | tail -8 | tee -a "$OUT/triage.log"
  echo "exit $rc" | tee -a "$OUT/triage.log"
  if [ "$rc" = 0 ] && [ "$found" = 0 ]; then chosen="$args" found=1; fi
done
rm -f "$OUT/stress.log"
echo "== bls_stress mixed (host and GPU tensors in one response) [${chosen}]" | tee -a "$OUT/triage.log"
timeout 90 "$PY" tools/bls_stress/run.py --device mixed --concurrency 32 --rounds 6 ${chosen:+--triton-arg=$chosen} \
  2>&1 | grep -v threading.py | tail -8 | tee -a "$OUT/triage.log"
echo "== bls_stress cpu, each call left at its first response (--early) [${chosen}]" | tee -a "$OUT/triage.log"
timeout 90 "$PY" tools/bls_stress/run.py --device cpu --state 1000 --concurrency 48 --rounds 10 --early \
  ${chosen:+--triton-arg=$chosen} 2>&1 | grep -v threading.py | tail -4 | tee -a "$OUT/triage.log"
echo "== chosen tritonserver arguments: [${chosen}]" | tee -a "$OUT/triage.log"
SMOKE_TRITON_ARGS="$chosen" SMOKE_BURSTS=16,64 timeout 200 "$PY" -m perf.gpu_smoke "$OUT/smoke.json" gpu \
  > "$OUT/smoke.log" 2>&1
grep '^{"n"' "$OUT/smoke.log" | cut -c1-300 | tee -a "$OUT/triage.log"
if "$PY" -c "import json,sys; r=json.load(open('$OUT/smoke.json'))['gpu']; sys.exit(r.get('burst_16',{}).get('ok')!=16)"; then
  PERF_TRITON_ARGS="$chosen" PERF_BUDGET_S=${PERF_BUDGET_S:-300} PERF_HARD_LIMIT_S=${PERF_HARD_LIMIT_S:-320} \
    bash perf/gpu_bench.sh "$OUT/bench" --w1-concurrency 1 16 32 64 --baseline-cap-s 90 --baseline-requests 1 \
    > "$OUT/bench_console.log" 2>&1
  tail -c 2000 "$OUT/bench/gpu_bench.log" | tee -a "$OUT/triage.log"
else
  echo "burst of 16 failed: bench skipped (evidence-gpu.tar.gz has the stacks)" | tee -a "$OUT/triage.log"
fi
