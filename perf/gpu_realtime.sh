#!/usr/bin/env bash
# One device call (~5 minutes): the full-size config on dummy bf16 weights, then on that one server the
# realtime load at 32 and 64 sessions (3 turns each) and W1 at 64 streams (the text-to-speech figure that
# must not fall). Writes into OUT:
#   realtime.json  w1.json  w1.png  metrics_after_realtime.txt  metrics_after_w1.txt  (omni_* lines of
#   Triton's metrics: Code2Wav round trips, milestones)  server_logs.txt (tails)  gpu_realtime.log
#
#   source .carry/device/env.sh && bash perf/gpu_realtime.sh $OUT
# Knobs (environment), for a smoke run of the script on the CPU: PERF_MODEL, PERF_DEVICE, PERF_SESSIONS,
# PERF_W1_CONCURRENCY, PERF_PORT_BASE (18200: http, +1 grpc, +2 metrics, +91 the frontend), e.g.
#   PERF_MODEL=checkpoints/tiny PERF_DEVICE=cpu PERF_SESSIONS=2 PERF_W1_CONCURRENCY=2 bash perf/gpu_realtime.sh /tmp/rt
set -u
OUT="${1:?usage: bash perf/gpu_realtime.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN=.run/gpu_realtime
BASE="${PERF_PORT_BASE:-18200}"
API=http://127.0.0.1:$((BASE + 91))
LOG="$OUT/gpu_realtime.log"

metrics() {  # the omni_* series of Triton's metrics endpoint
  "$PY" -c 'import urllib.request; print("".join(l for l in urllib.request.urlopen("http://127.0.0.1:'$((BASE + 2))'/metrics",
timeout=10).read().decode().splitlines(True) if l.startswith("omni_")))' > "$1" 2>&1
}

echo "[gpu_realtime] $(date -u +%FT%TZ) start" | tee "$LOG"
MODEL="${PERF_MODEL:-dummy:perf/qwen3_omni_30b_a3b_instruct.config.json}"
timeout -k 10 560 "$PY" -m perf.bench_server --model "$MODEL" --device "${PERF_DEVICE:-cuda}" --max-seq-len 3584 \
  --run-dir "$RUN" --http-port "$BASE" --grpc-port $((BASE + 1)) --metrics-port $((BASE + 2)) \
  --api-port $((BASE + 91)) --ready-timeout 300 >> "$LOG" 2>&1 &
SERVER=$!
for _ in $(seq 1 330); do  # bounded: the server says ready, or exits
  grep -q "\[bench_server\] serving" "$LOG" && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 1
done
if grep -q "\[bench_server\] serving" "$LOG"; then
  echo "[gpu_realtime] $(date -u +%FT%TZ) server ready" | tee -a "$LOG"
  timeout -k 5 150 "$PY" -m perf.realtime_load --url "$API" --sessions ${PERF_SESSIONS:-32 64} --turns 3 --turn-timeout 30 \
    --out "$OUT/realtime.json" 2>&1 | tee -a "$LOG"
  metrics "$OUT/metrics_after_realtime.txt"
  timeout -k 5 90 "$PY" -m perf.loadgen --url "$API" --workload w1 --concurrency "${PERF_W1_CONCURRENCY:-64}" \
    --prompts-per-level-factor 5 --level-timeout 60 --out "$OUT/w1.json" 2>&1 | tail -n 20 | tee -a "$LOG"
  metrics "$OUT/metrics_after_w1.txt"
else
  echo "[gpu_realtime] the server did not become ready" | tee -a "$LOG"
fi
kill -TERM "$SERVER" 2>/dev/null
wait "$SERVER"
for f in "$RUN"/*.log; do [ -f "$f" ] && { echo "==== $f"; tail -n 80 "$f"; }; done > "$OUT/server_logs.txt" 2>&1
echo "[gpu_realtime] $(date -u +%FT%TZ) done" | tee -a "$LOG"
exit 0
