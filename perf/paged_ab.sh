#!/usr/bin/env bash
# One GPU device call (~6 minutes): the paged KV cache with long contexts beside many short streams
# (perf/paged_ab.py): W1 at 64, then 64 W1 streams with 4 x 30,000-token prompts, then one 60,000-token
# prompt alone. Writes OUT/paged_ab.json, OUT/server_log_tail.txt and OUT/paged_ab.log, and OUT/stacks.tar.gz
# (every stub's thread stacks) after a level whose deadline cut a request.
#
#   source .carry/device/env.sh && bash perf/paged_ab.sh $OUT/paged
# The static cache's side of the A/B (an older tree): bash perf/gpu_bench.sh $OUT/static --skip-baseline
#   --w1-concurrency 64 --skip-w2. Knobs: PERF_BUDGET_S (330), PERF_HARD_LIMIT_S (360); extra args go to
# perf.paged_ab (--w1-only, --max-seq-len N).
set -u
OUT="${1:?usage: bash perf/paged_ab.sh OUT_DIR [perf.paged_ab args]}"
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout -k 15 "${PERF_HARD_LIMIT_S:-360}" "$PY" -m perf.paged_ab --out "$OUT" "$@" 2>&1 | tail -c 2000000 > "$OUT/paged_ab.log"
echo "[paged_ab.sh] exit ${PIPESTATUS[0]}" | tee -a "$OUT/paged_ab.log"
tail -n 30 "$OUT/paged_ab.log"
