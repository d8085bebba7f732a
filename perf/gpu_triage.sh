#!/usr/bin/env bash
# One GPU device call (~9 min): check on the H200 that the stub does not crash, then the bench.
#  1. tools/bls_stress with large host tensors, dropped by the stub's own thread (faults in its first round
#     on the H200) and held by the reaper as omni_ensemble holds them (omnistage/triton/iterator_reaper.py);
#  2. the served smoke (single W1 requests, bursts of 16 and 64);
#  3. perf/gpu_bench.sh if the burst of 16 passed.
#
#   source .carry/device/env.sh && bash perf/gpu_triage.sh $OUT
set -u
OUT="${1:?usage: bash perf/gpu_triage.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
for flag in "" "--reaper --free-probe"; do
  echo "== bls_stress cpu [$flag]" | tee -a "$OUT/triage.log"
  timeout 90 "$PY" tools/bls_stress/run.py --device cpu --concurrency 32 --rounds 6 $flag 2>&1 \
    | grep -v threading.py | tail -8 | tee -a "$OUT/triage.log"
done
SMOKE_BURSTS=16,64 timeout 200 "$PY" -m perf.gpu_smoke "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
grep '^{"n"' "$OUT/smoke.log" | cut -c1-300 | tee -a "$OUT/triage.log"
if "$PY" -c "import json,sys; r=json.load(open('$OUT/smoke.json'))['full']; sys.exit(r.get('burst_16',{}).get('ok')!=16)"; then
  PERF_BUDGET_S=${PERF_BUDGET_S:-300} PERF_HARD_LIMIT_S=${PERF_HARD_LIMIT_S:-320} \
    bash perf/gpu_bench.sh "$OUT/bench" --w1-concurrency 1 16 32 64 --baseline-cap-s 90 --baseline-requests 1 \
    > "$OUT/bench_console.log" 2>&1
  tail -c 2000 "$OUT/bench/gpu_bench.log" | tee -a "$OUT/triage.log"
else
  echo "burst of 16 failed: bench skipped (evidence-gpu.tar.gz has the stacks)" | tee -a "$OUT/triage.log"
fi
