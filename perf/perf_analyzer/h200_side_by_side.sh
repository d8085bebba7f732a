#!/usr/bin/env bash
# One GPU device call (about 8 minutes): the full-size config with dummy bf16 weights served once, then the
# W1 sweep at concurrency 1, 16 and 64 by perf_analyzer (straight into omni_ensemble) and by perf.loadgen
# (through the OpenAI frontend), then the two side by side. Writes into OUT:
#   pa/summary.json (+ one log per run)  loadgen.json  loadgen.png  side_by_side.json  server.log  run.log
#
#   source .carry/device/env.sh && bash perf/perf_analyzer/h200_side_by_side.sh $OUT
set -u
OUT="${1:?usage: bash perf/perf_analyzer/h200_side_by_side.sh OUT_DIR}"
LEVELS="${PA_LEVELS:-1 16 64}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[h200_side_by_side] $(date -u +%T) $*" | tee -a "$OUT/run.log"; }

log "starting the server (dummy full-size weights, cuda)"
timeout -k 10 560 "$PY" -m perf.bench_server --model dummy:perf/qwen3_omni_30b_a3b_instruct.config.json \
    --device cuda --max-seq-len 3584 --run-dir /tmp/pa_side_by_side --http-port 18200 --grpc-port 18201 \
    --metrics-port 18202 --api-port 18291 --ready-timeout 300 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 300); do
  curl -sf http://127.0.0.1:18291/health >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { log "server exited"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
log "server ready; perf_analyzer $(perf_analyzer --version 2>&1 | head -1)"
# the same warm-up for both tools: 5 requests first, not measured
timeout 240 "$PY" -m perf.perf_analyzer.sweep --url 127.0.0.1:18201 --models omni_ensemble \
    --concurrency $LEVELS --requests-per-level 2 --warmup 5 --out "$OUT/pa" 2>&1 | tee -a "$OUT/run.log"
timeout 240 "$PY" -m perf.loadgen --url http://127.0.0.1:18291 --workload w1 --concurrency $LEVELS \
    --prompts-per-level-factor 2 --warmup 5 --out "$OUT/loadgen.json" 2>&1 | tail -20 | tee -a "$OUT/run.log"
"$PY" -m perf.perf_analyzer.side_by_side "$OUT/pa/summary.json" "$OUT/loadgen.json" --out "$OUT/side_by_side.json" \
    2>&1 | tee -a "$OUT/run.log"
tail -c 2000000 "$OUT/server.log" > "$OUT/server.log.tmp" && mv "$OUT/server.log.tmp" "$OUT/server.log"
log "done"
