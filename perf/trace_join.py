# Where a request waits between the processes: the load generator's records joined by request id with the
# frontend's and omni_ensemble's request traces (OMNI_TRACE_DIR, omnistage/core/request_trace.py), as mean ms
# per hop of the first text token's and the first audio chunk's way to the client. All stamps are
# perf_counter values of one host (CLOCK_MONOTONIC), so the client, the frontend and the server must share it.
#
#   python -m perf.trace_join LOADGEN_RESULTS.json TRACE_DIR    (loadgen --out; every level in it)
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# hop name -> (from, to): points of one request's way, in seconds on the host's clock (see _points)
TEXT_HOPS = {
    "client: start -> request written": ("client_start", "client_sent"),
    "client -> frontend arrival": ("client_sent", "frontend_arrival"),
    "frontend: arrival -> handled (body parsed, planned)": ("frontend_arrival", "frontend_handled"),
    "frontend -> omni_ensemble arrival": ("frontend_handled", "ensemble_arrival"),
    "omni_ensemble: arrival -> first thinker output": ("ensemble_arrival", "ensemble_first_token"),
    "omni_ensemble -> frontend (first token)": ("ensemble_first_token", "frontend_first_token"),
    "frontend -> client (first token)": ("frontend_first_token", "client_first_token"),
}
AUDIO_HOPS = {
    "omni_ensemble: arrival -> first audio sent": ("ensemble_arrival", "ensemble_first_audio"),
    "omni_ensemble -> frontend (first audio)": ("ensemble_first_audio", "frontend_first_audio"),
    "frontend -> client (first audio)": ("frontend_first_audio", "client_first_audio"),
}


def load_traces(directory: Path) -> dict[str, dict[str, dict]]:
    """component (file name before its pid) -> request id -> its trace record."""
    traces: dict[str, dict[str, dict]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        component = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                traces.setdefault(component, {})[record["id"]] = record
    return traces


def _points(request: dict, front: dict, ensemble: dict) -> dict[str, float | None]:
    start = request["start"]
    timeline = ensemble.get("timeline_ms") or {}

    def at(base: float, ms: float | None) -> float | None:
        return None if ms is None else base + ms / 1e3

    return {
        "client_start": start,
        "client_sent": None if request.get("sent") is None else start + request["sent"],
        "frontend_arrival": front["arrival"],
        "frontend_handled": front.get("handled"),
        "ensemble_arrival": ensemble["arrival"],
        # omni_ensemble emits a token's text as it reads the thinker's response
        "ensemble_first_token": at(ensemble["arrival"], timeline.get("thinker_first_output")),
        "ensemble_first_audio": at(ensemble["arrival"], timeline.get("first_audio_sent")),
        "frontend_first_token": front.get("first_token"),
        "frontend_first_audio": front.get("first_audio"),
        "client_first_token": None if request.get("ttft") is None else start + request["ttft"],
        "client_first_audio": None if request.get("ttfp") is None else start + request["ttfp"],
    }


def hop_means(requests: list[dict], traces: dict[str, dict[str, dict]]) -> dict:
    """Mean ms of every hop over the completed requests found in both traces, and how many that was."""
    front_by_id, ensemble_by_id = traces.get("frontend", {}), traces.get("omni_ensemble", {})
    sums: dict[str, list[float]] = {}
    joined = 0
    for request in requests:
        front, ensemble = front_by_id.get(request.get("id")), ensemble_by_id.get(request.get("id"))
        if request.get("status") != "ok" or front is None or ensemble is None:
            continue
        joined += 1
        points = _points(request, front, ensemble)
        for name, (a, b) in {**TEXT_HOPS, **AUDIO_HOPS}.items():
            if points[a] is not None and points[b] is not None:
                sums.setdefault(name, []).append(points[b] - points[a])
    means = {name: round(1e3 * sum(v) / len(v), 1) for name, v in sums.items()}
    return {"requests_joined": joined, "requests": len(requests), "mean_ms": means}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.trace_join", description=__doc__)
    ap.add_argument("results", type=Path, help="perf.loadgen's results JSON (--out)")
    ap.add_argument("trace_dir", type=Path, help="the server's OMNI_TRACE_DIR")
    args = ap.parse_args(argv)
    traces = load_traces(args.trace_dir)
    for level in json.loads(args.results.read_text())["levels"]:
        print(f"c={level['concurrency']}: {json.dumps(hop_means(level.get('requests', []), traces))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
