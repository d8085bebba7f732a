#!/usr/bin/env bash
# Samples every stage process of a running server with py-spy once a benchmark level starts: what a stage's
# engine and response threads are doing under load, and which of them holds the GIL.
#   bash perf/spy_stages.sh CONSOLE_LOG PATTERN OUT_DIR [SECONDS]
# waits until PATTERN appears in CONSOLE_LOG (e.g. gpu_bench's "w1 c=64: 320 prompts"), then records each
# Python backend stub (by model name), the frontend and the load generator (perf.gpu_bench's process) for
# SECONDS (default 3) into OUT_DIR/<name>.<pid>.txt, every thread, waiting or not (--idle), then as long
# again into OUT_DIR/<name>.<pid>.gil.txt, only the thread holding the GIL at each sample (--gil).
# py-spy's raw format: one "stack count" line per distinct stack, the thread first (--threads).
# Needs py-spy on PATH and ptrace rights on the processes.
set -u
LOG=${1:?console log} PATTERN=${2:?pattern} OUT=${3:?out dir} SECONDS_=${4:-3}
mkdir -p "$OUT"
for _ in $(seq 1 600); do grep -q "$PATTERN" "$LOG" 2>/dev/null && break; sleep 0.5; done
sleep 1  # past the level's first arrivals
pids=()
while read -r pid args; do
  case $args in
    *triton_python_backend_stub*) name=$(grep -o '[a-z_0-9]*/[0-9]*/model.py' <<< "$args" | cut -d/ -f1) ;;
    *openai_frontend*) name=frontend ;;
    *perf.gpu_bench*) name=loadgen ;;
    *) continue ;;
  esac
  [ -n "$name" ] || continue
  (py-spy record --nonblocking --idle --threads -f raw -r 100 -d "$SECONDS_" -p "$pid" -o "$OUT/$name.$pid.txt" \
     > "$OUT/$name.$pid.log" 2>&1
   py-spy record --nonblocking --gil --threads -f raw -r 100 -d "$SECONDS_" -p "$pid" -o "$OUT/$name.$pid.gil.txt" \
     >> "$OUT/$name.$pid.log" 2>&1) &
  pids+=($!)
done < <(ps -eo pid=,args=)
wait "${pids[@]}"
