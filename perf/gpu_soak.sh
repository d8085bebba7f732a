#!/usr/bin/env bash
# One GPU device call (~8 minutes at most): perf/soak.py's mixed load (text, long chats of ~3000 tokens and
# audio prompts; streamed and not; text and spoken replies; a tenth of the clients leaving early) at 64
# streams on one H200 with the full-size config's dummy weights, for 60 s of warm-up and 240 s of soak,
# every process's RSS and threads (each stub by its instance) sampled every 15 s, and whether each levelled
# off after the warm-up (perf/proc_sampler.py). Writes into OUT:
#   soak_gpu.json  the report: counts, before / after snapshots, samples, levelling, problems
#   soak_gpu.log   the console (the report without its samples)
#
#   source .carry/device/env.sh && bash perf/gpu_soak.sh $OUT
set -u
OUT="${1:?usage: bash perf/gpu_soak.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the server's start (up to ~4 minutes), 300 s of load, the idle wait and the stop stay inside 570 s
timeout -k 15 570 "$PY" -m perf.soak --model dummy:perf/qwen3_omni_30b_a3b_instruct.config.json --device cuda \
    --concurrency 64 --warmup 60 --duration 240 --long-chat-words 3000 --cancel-fraction 0.1 --sample-every 15 \
    --run-dir /tmp/omni-soak --first-port 21400 --out "$OUT/soak_gpu.json" 2>&1 | tail -c 4000000 > "$OUT/soak_gpu.log"
echo "[gpu_soak.sh] exit ${PIPESTATUS[0]}" >> "$OUT/soak_gpu.log"
exit 0
