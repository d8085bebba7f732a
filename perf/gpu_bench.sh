#!/usr/bin/env bash
# One GPU device call (~9 minutes at most): transformers baseline, then our server on the same dummy
# full-size weights, W1 sweep (1 16 64) and a short W2 subset. Writes into OUT (5 files at most):
#   bench.json  bench.png  server_log_tail.txt  gpu_bench.log, and stacks.tar.gz (every stub's thread
#   stacks, dumped after a level whose deadline cut requests: the evidence of a stall)
#
#   source .carry/device/env.sh && bash perf/gpu_bench.sh $OUT
# Knobs (environment): PERF_BUDGET_S (510: the Python side's own budget), PERF_HARD_LIMIT_S (555: kill
# after this), PERF_MAX_SEQ_LEN (3584), PERF_W1_FACTOR (2), PERF_SKIP_W2=1; extra args go to perf.gpu_bench.
set -u
OUT="${1:?usage: bash perf/gpu_bench.sh OUT_DIR [perf.gpu_bench args]}"
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
HARD="${PERF_HARD_LIMIT_S:-555}"

echo "[gpu_bench.sh] $(date -u +%FT%TZ) python=$PY hard limit ${HARD}s" | tee "$OUT/gpu_bench.log"
# -k: SIGKILL 15 s after the SIGTERM; gpu_bench.py turns SIGTERM into a clean stop that still writes bench.json
timeout -k 15 "$HARD" "$PY" -m perf.gpu_bench --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "[gpu_bench.sh] exit $rc at $(date -u +%FT%TZ)" | tee -a "$OUT/gpu_bench.log"

if [ ! -s "$OUT/bench.json" ]; then  # killed before the first save: leave a marker with the log's end
  "$PY" - "$OUT" "$rc" <<'EOF'
import json, sys, pathlib
out, rc = pathlib.Path(sys.argv[1]), sys.argv[2]
tail = (out / "gpu_bench.log").read_text(errors="replace").splitlines()[-60:]
(out / "bench.json").write_text(json.dumps({"status": f"no results (exit {rc})", "log_tail": tail}, indent=1))
EOF
fi
# the console log can grow with progress bars; keep what comes back small
if [ "$(stat -c %s "$OUT/gpu_bench.log")" -gt 4000000 ]; then
  tail -c 4000000 "$OUT/gpu_bench.log" > "$OUT/gpu_bench.log.tmp" && mv "$OUT/gpu_bench.log.tmp" "$OUT/gpu_bench.log"
fi
exit 0
