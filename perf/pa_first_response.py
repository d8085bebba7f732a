# First-response latency (TTFP) and friends from a perf_analyzer --profile-export-file, whose documented
# layout (perf_analyzer src/profile_data_exporter.cc) is
#   {"version", "service_kind", "endpoint",
#    "experiments": [{"experiment": {"mode": "concurrency" | "request_rate", "value": N},
#                     "requests": [{"timestamp": ns, "sequence_id"?: n, "request_inputs": {...},
#                                   "response_timestamps": [ns, ...], "response_outputs": [{name: value}, ...]}],
#                     "window_boundaries": [ns, ...]}]}
# Timestamps are nanoseconds of the client's system clock; a response output is a number (one element),
# a list (several), a string (BYTES) or "" (empty tensor). An output a response did not carry, or an empty
# FP32 one, can come out as a bare number too (0.0 or a stale value), so audio counts only as a list of
# samples: a real audio chunk holds hundreds of them.
#   first_response : first response - request send time (omni_ensemble: its first text delta)
#   ttfp           : first response whose `audio` output has samples - send time (when outputs were recorded)
#   ttft           : first response with non-empty `token_ids` / `text`
#   e2e            : last response (the empty final one included) - send time
#
#   python -m perf.pa_first_response profile_export.json [--out summary.json]
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from perf.metrics import summarize

NS_PER_MS = 1e6
TEXT_OUTPUTS = ("token_ids", "text", "text_output")


def non_empty(value) -> bool:
    if isinstance(value, list):
        return len(value) > 0
    if isinstance(value, str):
        return value != ""
    return value is not None


def has_samples(value) -> bool:
    return isinstance(value, list) and len(value) > 0


def _first(sent: int, stamps: list[int], outputs: list[dict], names: tuple[str, ...], found=non_empty) -> float | None:
    for t, out in zip(stamps, outputs):
        if any(found(out.get(n, "")) for n in names):
            return (t - sent) / NS_PER_MS
    return None


def request_latencies(request: dict, audio_output: str = "audio") -> dict:
    sent, stamps = request["timestamp"], request.get("response_timestamps") or []
    outputs = request.get("response_outputs") or []
    return {
        "first_response_ms": (stamps[0] - sent) / NS_PER_MS if stamps else None,
        "ttft_ms": _first(sent, stamps, outputs, TEXT_OUTPUTS),
        "ttfp_ms": _first(sent, stamps, outputs, (audio_output,), has_samples),
        "e2e_ms": (stamps[-1] - sent) / NS_PER_MS if stamps else None,
        "responses": len(stamps),
    }


def experiment_summary(experiment: dict, audio_output: str = "audio") -> dict:
    requests = experiment.get("requests") or []
    per = [request_latencies(r, audio_output) for r in requests]
    answered = [r for r in requests if r.get("response_timestamps")]
    windows = experiment.get("window_boundaries") or []
    if len(windows) >= 2:
        span_ns, lo, hi = windows[-1] - windows[0], windows[0], windows[-1]
        done = sum(1 for r in answered if lo <= r["response_timestamps"][-1] <= hi)
    elif answered:
        span_ns = max(r["response_timestamps"][-1] for r in answered) - min(r["timestamp"] for r in answered)
        done = len(answered)
    else:
        span_ns, done = 0, 0
    return {
        "mode": (experiment.get("experiment") or {}).get("mode"),
        "value": (experiment.get("experiment") or {}).get("value"),
        "requests": len(requests),
        "answered": len(answered),
        "throughput_rps": done / (span_ns / 1e9) if span_ns > 0 else None,
        **{k: summarize([p[k] for p in per]) for k in ("first_response_ms", "ttft_ms", "ttfp_ms", "e2e_ms")},
        "outputs_recorded": any(r.get("response_outputs") for r in requests),
    }


def summarize_export(doc: dict, audio_output: str = "audio") -> list[dict]:
    return [experiment_summary(e, audio_output) for e in doc.get("experiments") or []]


def _ms(stat: dict | None) -> str:  # mean/median/p99
    return "-" if not stat else f"{stat['mean']:.1f}/{stat['median']:.1f}/{stat['p99']:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m perf.pa_first_response", description="TTFP from a perf_analyzer profile export"
    )
    ap.add_argument("profile_export", type=Path)
    ap.add_argument("--audio-output", default="audio", help="output whose first non-empty response is TTFP")
    ap.add_argument("--out", type=Path, help="summary JSON")
    args = ap.parse_args(argv)
    rows = summarize_export(json.loads(args.profile_export.read_text()), args.audio_output)
    print("mode         value  requests  req/s    first resp ms    TTFT ms          TTFP ms          E2E ms")
    for r in rows:
        rps = "-" if r["throughput_rps"] is None else f"{r['throughput_rps']:.3f}"
        print(
            f"{r['mode'] or '?':<12} {r['value']!s:>5}  {r['requests']:>8}  {rps:>6}  "
            f"{_ms(r['first_response_ms']):>15}  "
            f"{_ms(r['ttft_ms']):>15}  {_ms(r['ttfp_ms']):>15}  {_ms(r['e2e_ms']):>15}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
