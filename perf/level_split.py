# Where each level of a gpu_bench run spent its time, from its bench.json (gzipped or not): the level's
# req/s, TTFP and RTF, the trace hops, and the change over the level of the stages' own counters and of
# Triton's per-model request counters (gpu_bench records both before and after every level):
#   - thinker and talker: steps, prefill and decode seconds, and per sequence the wait for admission and
#     the time from its arrival in the stage to its first output;
#   - Triton, per model: per request, the wait in Triton's queue for execute(), the input copy, the request;
#   - Code2Wav: a chunk's round trip as omni_ensemble sees it, against the main lane's execute() to response
#     sent, the wait of a decoded chunk for its response thread, and send();
#   - omni_ensemble's milestones (arrival to each, means).
#
#   python -m perf.level_split bench.json.gz [--json out.json]
from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

TRITON_MODELS = ("omni_ensemble", "thinker", "talker", "code2wav")


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def delta(before: dict, after: dict, key: str) -> float | None:
    """The change of a series (summed over its instances) over a level; None when the server had none."""
    if not after.get(key):
        return None
    return sum(after[key]) - sum(before.get(key) or [])


def _labelled(before: dict, after: dict, name: str, label: str) -> dict[str, float]:
    """label value -> the change of name{...label="value"...}, summed over the other labels."""
    out: dict[str, float] = {}
    for key in after:
        if key.startswith(name + "{") and (m := re.search(f'{label}="([^"]+)"', key)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + (delta(before, after, key) or 0.0)
    return out


def _per(total: float | None, n: float | None, scale: float = 1e3) -> float | None:
    return round(total / n * scale, 1) if total is not None and n else None


def split(before: dict, after: dict) -> dict:
    def d(key: str) -> float | None:
        value = delta(before, after, key)
        return None if value is None else round(value, 3)

    out: dict = {}
    for stage in ("thinker", "talker"):
        n = d(f"omni_{stage}_first_outputs_total")
        if n:
            out[stage] = {"sequences": n, "steps": d(f"omni_{stage}_steps_total"),
                          "prefill_s": d(f"omni_{stage}_prefill_seconds_total"),
                          "decode_s": d(f"omni_{stage}_decode_seconds_total"),
                          "queue_ms": _per(d(f"omni_{stage}_queue_seconds_total"), n),
                          "first_output_ms": _per(d(f"omni_{stage}_first_output_seconds_total"), n)}  # fmt: skip
    triton = {}
    for model in TRITON_MODELS:
        series = lambda what: d(f'nv_inference_{what}{{model="{model}",version="1"}}')  # noqa: E731
        n = series("request_success")
        if n:
            triton[model] = {"requests": n, "queue_ms": _per(series("queue_duration_us"), n, 1e-3),
                             "compute_input_ms": _per(series("compute_input_duration_us"), n, 1e-3),
                             "request_ms": _per(series("request_duration_us"), n, 1e-3)}  # fmt: skip
    if triton:
        out["triton"] = triton
    hops = _labelled(before, after, "omni_handoff_latency_seconds_sum", "hop")
    counts = _labelled(before, after, "omni_handoff_latency_seconds_count", "hop")
    if counts.get("code2wav"):
        main = d("omni_code2wav_main_chunks_total")
        responses = (main or 0) + (d("omni_code2wav_first_chunks_total") or 0)
        out["code2wav"] = {"round_trip_ms": _per(hops["code2wav"], counts["code2wav"]),
                           "main_chunks": main, "main_in_stage_ms": _per(d("omni_code2wav_main_chunk_seconds_total"), main),
                           "response_wait_ms": _per(d("omni_code2wav_response_delay_seconds_total"), responses),
                           "send_ms": _per(d("omni_code2wav_response_send_seconds_total"), responses),
                           # later chunks replayed as graphs, and the forwards of both lanes (a replay, or an
                           # eager forward of one shape, each)
                           "graphed_chunks": d("omni_code2wav_later_chunks_total"),
                           "forwards": d("omni_code2wav_forwards_total"),
                           "busy_s": d("omni_code2wav_busy_seconds_total")}  # fmt: skip
    sums = _labelled(before, after, "omni_milestone_seconds_sum", "milestone")
    ns = _labelled(before, after, "omni_milestone_seconds_count", "milestone")
    if ns:
        out["milestones_ms"] = {m: _per(sums[m], ns[m]) for m in sums if ns.get(m)}
    return out


def levels(report: dict) -> list[dict]:
    """Every load level of the report (W1, media, W2 sweeps, realtime) with its split."""
    rows = []
    for workload, result in report.get("ours", {}).items():
        for level in result.get("levels", []):
            if "stage_metrics_after" not in level:
                continue
            stat = lambda k: (level.get(k) or {}).get("mean")  # noqa: E731
            rows.append({"level": f"{workload} c={level['concurrency']}", "req_s": level.get("throughput_rps"),
                         "ttfp_ms": stat("ttfp_ms"), "rtf": stat("rtf"),
                         "hops_ms": (level.get("trace_hops") or {}).get("mean_ms"),
                         **split(level["stage_metrics_before"], level["stage_metrics_after"])})  # fmt: skip
    for level in (report.get("realtime") or {}).get("levels", []):
        if "stage_metrics_after" in level:
            rows.append({"level": f"realtime {level['sessions']} sessions", "latency_ms": level.get("latency_ms"),
                         "turns_with_underruns": level.get("turns_with_underruns"),
                         **split(level["stage_metrics_before"], level["stage_metrics_after"])})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bench", type=Path, help="a gpu_bench bench.json or bench.json.gz")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    rows = levels(load(a.bench))
    for row in rows:
        print(f"== {row['level']}")
        for key, value in row.items():
            if key != "level" and value is not None:
                print(f"  {key}: {json.dumps(value)}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
