#!/usr/bin/env bash
# One GPU device call that serves two trees in turn with the same gpu_bench levels: an earlier commit (the
# base), then this tree. The device gets the working tree only (no git history), so the base travels as an
# archive made here and carried with it:
#
#   git archive --format=tar.gz -o .carry/base.tar.gz <commit> ':!perf/results'   # here (~1 MB); carry it
#   source .carry/device/env.sh && PERF_BUDGET_S=250 bash perf/tree_ab.sh $OUT .carry/base.tar.gz \
#       --skip-baseline --w1-concurrency 64 --media w3:64 --realtime 32
#
# Writes OUT/base.bench.json.gz and OUT/head.bench.json.gz (read them with python -m perf.level_split) and
# OUT/tree_ab.log. Each side gets PERF_BUDGET_S (gpu_bench's own knobs apply); PERF_SKIP_W2 defaults to 1.
set -u
OUT="${1:?usage: bash perf/tree_ab.sh OUT_DIR BASE.tar.gz [gpu_bench args]}"
BASE_ARCHIVE="${2:?usage: bash perf/tree_ab.sh OUT_DIR BASE.tar.gz [gpu_bench args]}"
shift 2
mkdir -p "$OUT"
HEAD_DIR="$(cd "$(dirname "$0")/.." && pwd)"
BASE_DIR="$(mktemp -d /tmp/tree_ab_base.XXXXXX)"
tar xzf "$BASE_ARCHIVE" -C "$BASE_DIR"
ln -s "$HEAD_DIR/.carry" "$BASE_DIR/.carry"  # the same tritonserver and wheels for both sides
export PERF_SKIP_W2="${PERF_SKIP_W2:-1}"
for side in base head; do
  dir=$([ "$side" = base ] && echo "$BASE_DIR" || echo "$HEAD_DIR")
  run="$(mktemp -d /tmp/tree_ab_$side.XXXXXX)"
  echo "[tree_ab] $side: $dir" | tee -a "$OUT/tree_ab.log"
  (cd "$dir" && bash perf/gpu_bench.sh "$run" "$@") > "$run/console.txt" 2>&1
  levels=$(grep -E " c=[0-9]+: done|realtime [0-9]+:" "$run/console.txt")
  echo "${levels:-$(tail -n 5 "$run/console.txt")}" | tee -a "$OUT/tree_ab.log"
  # what each side's server start spent on CUDA graphs (gpu_bench leaves the stages' logs in its temp dir)
  logs=$(ls -dt /tmp/omnistage_gpu_bench_* 2>/dev/null | head -n 1)
  [ -n "$logs" ] && grep -rhoE "\[[a-z0-9_]+\] captured [0-9]+ CUDA graphs in [0-9.]+ s" "$logs" \
    | sed "s/^/[tree_ab] $side /" | tee -a "$OUT/tree_ab.log"
  gzip -9 -n -c "$run/bench.json" > "$OUT/$side.bench.json.gz"
  rm -rf "$run"
done
rm -rf "$BASE_DIR"
