#!/usr/bin/env bash
# One GPU device call (~6 min): the W1 levels 1 and 64 under several deployments of the same dummy
# full-size model, each on a fresh server, so that their ratios come from one run on one machine. Each
# variant writes OUT/<variant>/bench.json (per level: stage busy seconds, CPU seconds per process, GPU
# utilisation) and one summary line to OUT/variants.log.
#
#   source .carry/device/env.sh && bash perf/gpu_variants.sh $OUT [variant ...]
# The device returns few files, so the variants' directories end up in OUT/variants.tar.gz.
# Variants: smoke (perf.gpu_smoke: per-request timelines of single requests and bursts), base (the cuda
# profile as it is), prefill16 (thinker/talker max_prefills_per_step 16, the cuda default from 83dea47 to the
# third session of 2026-12-04),
# scaled (prefill16 + 2 code2wav and 2 omni_ensemble instances), scaled_mps (scaled under the CUDA MPS
# daemon, when the machine has it), mps (base under CUDA MPS), gpu_inputs (prefill16 with the profile's
# gpu_inputs: true), step_stream (every GPU stage with step_stream: true), thinker_host (the thinker's
# responses as host tensors), host (every stage hands over host tensors: handoff cpu, the cuda default since
# the 2026-12-03 third session), host_mps (host under CUDA MPS), gpu_handoff (every stage hands over CUDA
# tensors: handoff gpu, the default before), first_chunk2 (first audio chunk after 2 frames: the cuda
# default since the fourth session of 2026-12-03), first_chunk4 (after 4 frames: vLLM-Omni's, our default
# before), bls_views (no model: tools/bls_stress with 4.8 MB host states kept as views of their BLS responses, as
# omni_ensemble did until 6cf3333, then copied as it does now: does holding views freeze the 2.51 stub on
# this machine? perf/README.md, 2026-12-03 third session), no_prefix (the thinker without its prefix cache:
# every prompt prefilled in full), omp1 (every process with OMP_NUM_THREADS=1: a stage's small host-tensor
# ops on torch's 16-thread pool?), no_first_lane (Code2Wav without its first lane: first chunks queue with
# the rest, eager; the default before the 2026-12-04 session), ensN (N omni_ensemble instances, e.g.
# ens2: the cuda default of the first two sessions of 2026-12-04, ens4 since), prefill8 (thinker and talker take at most 8 new prompts per
# step instead of 16: shorter prefill steps for a cohort of arrivals), prefill32 (32: a cohort in fewer
# steps; the cuda default since the third session of 2026-12-04), thinker_prefill32 (32 in the thinker only), first1 (first audio after 1 frame, the one the talker
# completes in its prefill step, sent without waiting for the step's decode: talker hold_prefill_outputs
# false; the cuda default since the second session of 2026-12-04), grouped_mm (transformers' grouped_mm
# experts in thinker and talker: the cuda default before lean_grouped_mm), lean_mm (lean_grouped_mm for every
# step size in thinker and talker: the cuda default before gather_or_grouped), no_gemv (one-row matmuls
# through cuBLAS instead of omnistage/models/gemv.py: OMNI_GEMV=0), no_router (transformers' MoE routers
# instead of omnistage/models/moe_router.py: OMNI_FUSED_ROUTER=0), eager_later (Code2Wav's later chunks eager,
# one forward per shape: code2wav later_chunk_batch 0, the cuda default before), first_first (every response
# thread sends a request's first output at the head of its round: model parameter first_responses_first,
# off by default), no_hold (thinker and talker send a request's prefill output as soon as the prefill phase
# ends instead of with the same step's decode output: the cuda default since the third session of
# 2026-12-04), thinker_hold (the thinker holds its prefill output for the step's decode output again: the
# cuda default before).
# Spread: at 64 streams with 320 prompts, base made 34.6-45.3 req/s and eager_later 39.6-45.6 across four
# calls of the fifth session of 2026-12-04, within calls too (a suspected slow first variant of a call was
# not reproduced: base run twice in one call, first 45.3, then 43.9).
# Interleave (a b a b) and compare within a call; a difference under ~10% at 64 says little.
set -u
OUT="${1:?usage: bash perf/gpu_variants.sh OUT_DIR [variant ...]}"
shift
VARIANTS=("${@:-smoke base prefill16 scaled scaled_mps}")
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PREFILL16=(--set thinker.max_prefills_per_step=16 --set talker.max_prefills_per_step=16)
SCALED=("${PREFILL16[@]}" --instances code2wav=2,omni_ensemble=2)
# the profile's gpu_inputs: true (CUDA inputs stay on the device instead of the Python backend's host copy)
GPU_INPUTS=("${PREFILL16[@]}" --set thinker.FORCE_CPU_ONLY_INPUT_TENSORS=no --set talker.FORCE_CPU_ONLY_INPUT_TENSORS=no
            --set code2wav.FORCE_CPU_ONLY_INPUT_TENSORS=no)
# the profile's step_stream: true on every GPU stage (engine steps on a CUDA stream of their own)
STEP_STREAM=(--set thinker.step_stream=true --set talker.step_stream=true --set code2wav.step_stream=true)
# the thinker's responses as host tensors (its stage-level handoff): does its slow send() come from the CUDA
# tensors it hands over? Compare omni_thinker_response_send_seconds_total with base
THINKER_HOST=(--set thinker.handoff=cpu)
# every stage's outputs in pinned host memory, copied at each step's own sync (stages/host_copy.py), and
# omni_ensemble's too: no stage response carries a CUDA tensor, so omni_ensemble never touches the GPU
HOST=(--set thinker.handoff=cpu --set talker.handoff=cpu --set code2wav.handoff=cpu --set omni_ensemble.handoff=cpu)
NO_PREFIX=(--set thinker.prefix_cache_bytes=0)
GPU_HANDOFF=(--set thinker.handoff=gpu --set talker.handoff=gpu --set code2wav.handoff=gpu --set omni_ensemble.handoff=gpu)

run_variant() {  # name, then perf.gpu_bench args
  local name=$1
  shift
  # budget: up to 100 s for the server to load and capture its graphs, 60 s for the levels, 25 s to stop
  PERF_BUDGET_S=${PERF_BUDGET_S:-185} PERF_HARD_LIMIT_S=${PERF_HARD_LIMIT_S:-200} bash perf/gpu_bench.sh "$OUT/$name" \
    --skip-baseline --skip-w2 --w1-concurrency 1 64 --warmup 3 --bench-min-s 60 "$@" > "$OUT/$name.console.log" 2>&1
  "$PY" - "$OUT/$name/bench.json" "$name" <<'PYEOF' | tee -a "$OUT/variants.log"
import json, re, sys
path, name = sys.argv[1:]
b = json.load(open(path))
for lv in b.get("ours", {}).get("w1", {}).get("levels", []):
    if "throughput_rps" not in lv:
        print(name, lv)
        continue
    m, before = lv["stage_metrics_after"], lv.get("stage_metrics_before", {})
    print(f"{name} c={lv['concurrency']}: {lv['completed']}/{lv['num_prompts']} {lv['throughput_rps']:.2f} req/s "
          f"TTFT {lv['ttft_ms']['mean']:.0f} TTFP {lv['ttfp_ms']['mean']:.0f} RTF {lv['rtf']['mean']:.3f} "
          f"wall {lv['wall_s']:.1f}s cpu {lv.get('cpu_seconds')} gpu {lv.get('gpu_utilization')}")
    # the level's mean time from arrival to each milestone (omni_milestone_seconds), in ms
    delta = lambda k: sum(m.get(k, [0])) - sum(before.get(k, [0]))  # noqa: E731
    keys = [k[len("omni_milestone_seconds_sum"):] for k in m if k.startswith("omni_milestone_seconds_sum{")]
    means = {re.search(r'milestone="([^"]+)"', k).group(1): round(1e3 * delta("omni_milestone_seconds_sum" + k) / n)
             for k in keys if (n := delta("omni_milestone_seconds_count" + k))}
    print(f"{name} c={lv['concurrency']} milestones_ms {dict(sorted(means.items(), key=lambda kv: kv[1]))}")
    # the frontend's view (arrival at the frontend -> received from Triton), against the client's TTFT / TTFP
    front = {h: round(1e3 * delta(f"omni_frontend_{h}_sum") / n) for h in ("queue_seconds", "time_to_first_token_seconds",
             "audio_ttfp_seconds") if (n := delta(f"omni_frontend_{h}_count"))}
    print(f"{name} c={lv['concurrency']} frontend_ms {front}")
    # the same request's stamps in the client, the frontend and omni_ensemble (perf/trace_join.py): mean ms per hop
    print(f"{name} c={lv['concurrency']} trace_ms {lv.get('trace_hops')}")
    # where the stages' and response threads' time went over the level (seconds, or counts)
    counters = {k.removeprefix("omni_"): round(delta(k), 2) for k in sorted(m) if not k.startswith("omni_milestone")
                and re.search(r"(seconds_total|_steps_total|responses_total|tokens_total|chunks_total|rows_total|outputs_total)$", k)}
    print(f"{name} c={lv['concurrency']} counters {counters}")
PYEOF
}

under_mps() {  # run_variant's arguments, with a CUDA MPS daemon of its own running (when the machine has one)
  if ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "$1: no nvidia-cuda-mps-control on this machine" | tee -a "$OUT/variants.log"
    return
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/omni-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/omni-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && run_variant "$@"
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

for v in ${VARIANTS[@]}; do
  case $v in
    smoke)  # gRPC straight to omni_ensemble: single requests and bursts with their mean timelines
      SMOKE_BURSTS=16,64 timeout 200 "$PY" -m perf.gpu_smoke "$OUT/smoke.json" gpu > "$OUT/smoke.log" 2>&1
      "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['gpu']
for s in r['single']: print('smoke single', {k: s.get(k) for k in ('ttft','ttfp','e2e')}, s['usage'].get('timeline_ms'))
for n in (16, 64): print('smoke burst', n, {k: v for k, v in r.get(f'burst_{n}', {}).items() if k != 'errors'})" \
        "$OUT/smoke.json" 2>&1 | tee -a "$OUT/variants.log" ;;
    base) run_variant base ;;
    prefill16) run_variant prefill16 "${PREFILL16[@]}" ;;
    scaled) run_variant scaled "${SCALED[@]}" ;;
    gpu_inputs) run_variant gpu_inputs "${GPU_INPUTS[@]}" ;;
    step_stream) run_variant step_stream "${STEP_STREAM[@]}" ;;
    thinker_host) run_variant thinker_host "${THINKER_HOST[@]}" ;;
    host) run_variant host "${HOST[@]}" ;;
    host_mps) under_mps host_mps "${HOST[@]}" ;;
    gpu_handoff) run_variant gpu_handoff "${GPU_HANDOFF[@]}" ;;
    first_chunk2) run_variant first_chunk2 --set omni_ensemble.first_chunk_frames=2 ;;
    first_chunk4) run_variant first_chunk4 --set omni_ensemble.first_chunk_frames=4 ;;
    no_prefix) run_variant no_prefix "${NO_PREFIX[@]}" ;;
    omp1) OMP_NUM_THREADS=1 run_variant omp1 ;;
    no_first_lane) run_variant no_first_lane --set code2wav.first_chunk_frames=0 ;;
    ens[1-9]|ens[1-9][0-9]) run_variant "$v" --instances omni_ensemble="${v#ens}" ;;
    thinker_hold) run_variant thinker_hold --set thinker.hold_prefill_outputs=true ;;
    no_hold) run_variant no_hold --set thinker.hold_prefill_outputs=false --set talker.hold_prefill_outputs=false ;;
    prefill8) run_variant prefill8 --set thinker.max_prefills_per_step=8 --set talker.max_prefills_per_step=8 ;;
    grouped_mm) run_variant grouped_mm --set thinker.experts_implementation=grouped_mm --set talker.experts_implementation=grouped_mm ;;
    no_gemv) OMNI_GEMV=0 run_variant no_gemv ;;
    no_router) OMNI_FUSED_ROUTER=0 run_variant no_router ;;
    eager_later) run_variant eager_later --set code2wav.later_chunk_batch=0 ;;
    lean_mm) run_variant lean_mm --set thinker.experts_implementation=lean_grouped_mm \
            --set talker.experts_implementation=lean_grouped_mm ;;
    first_first) run_variant first_first --set thinker.first_responses_first=true --set talker.first_responses_first=true \
            --set code2wav.first_responses_first=true --set omni_ensemble.first_responses_first=true ;;
    first1) run_variant first1 --set omni_ensemble.first_chunk_frames=1 --set code2wav.first_chunk_frames=1 \
            --set talker.hold_prefill_outputs=false ;;
    thinker_prefill32) run_variant thinker_prefill32 --set thinker.max_prefills_per_step=32 ;;
    prefill32) run_variant prefill32 --set thinker.max_prefills_per_step=32 --set talker.max_prefills_per_step=32 ;;
    bls_views)
      for flag in "--keep-views" ""; do
        echo "bls_views [$flag]" | tee -a "$OUT/variants.log"
        timeout 150 "$PY" tools/bls_stress/run.py --device cpu --concurrency 48 --rounds 60 --bf16-bytes --reaper \
          $flag --run-dir /tmp/bls_views 2>&1 | grep -v threading.py | tail -4 | tee -a "$OUT/variants.log"
      done ;;
    mps) under_mps mps ;;
    scaled_mps) under_mps scaled_mps "${SCALED[@]}" ;;
    *) echo "unknown variant $v" | tee -a "$OUT/variants.log" ;;
  esac
done
# the device returns few files: one archive of the variants' directories
dirs=$(cd "$OUT" && for v in ${VARIANTS[@]}; do [ -d "$v" ] && echo "$v"; done)
[ -n "$dirs" ] && tar czf "$OUT/variants.tar.gz" -C "$OUT" $dirs && (cd "$OUT" && rm -rf $dirs)
