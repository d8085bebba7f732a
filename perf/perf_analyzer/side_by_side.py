# perf_analyzer (gRPC straight into omni_ensemble) beside perf.loadgen (HTTP through the OpenAI frontend)
# at the same W1 concurrencies against one server: req/s, TTFT and time to first audio, per level.
#
#   python -m perf.perf_analyzer.side_by_side PA_SUMMARY.json LOADGEN.json [--out side_by_side.json]
#
# What differs between the two, by construction: loadgen's clock starts before the HTTP request and stops at
# the SSE event a client reads (frontend parse, gRPC hop, base64 + JSON per chunk included); perf_analyzer's
# at the gRPC send and the response's arrival. loadgen's req/s is completed requests over the level's wall
# time; perf_analyzer's over its measurement window.
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _mean(stat) -> float | None:
    return None if not stat else stat.get("mean")


def rows(pa: list[dict], loadgen: dict) -> list[dict]:
    by_c = {r["concurrency"]: r for r in loadgen.get("levels") or []}
    out = []
    for p in pa:
        if p.get("model") != "omni_ensemble":
            continue
        g = by_c.get(p["concurrency"], {})
        out.append({
            "concurrency": p["concurrency"],
            "pa_rps": p.get("throughput_rps"), "loadgen_rps": g.get("throughput_rps"),
            "pa_ttft_ms": _mean(p.get("ttft_ms")), "loadgen_ttft_ms": _mean(g.get("ttft_ms")),
            "pa_first_audio_ms": _mean(p.get("ttfp_ms")), "loadgen_first_audio_ms": _mean(g.get("ttfp_ms")),
            "pa_requests": p.get("answered"), "loadgen_requests": g.get("completed"),
        })  # fmt: skip
    return out


def _f(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.perf_analyzer.side_by_side")
    ap.add_argument("pa_summary", type=Path, help="perf.perf_analyzer.sweep's summary.json")
    ap.add_argument("loadgen", type=Path, help="perf.loadgen --out JSON")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    table = rows(json.loads(args.pa_summary.read_text()), json.loads(args.loadgen.read_text()))
    print("conc   req/s pa / loadgen   TTFT ms pa / loadgen   first audio ms pa / loadgen")
    for r in table:
        print(f"{r['concurrency']:>4}   {_f(r['pa_rps'], 3):>7} / {_f(r['loadgen_rps'], 3):<7}   "
              f"{_f(r['pa_ttft_ms']):>8} / {_f(r['loadgen_ttft_ms']):<8}   "
              f"{_f(r['pa_first_audio_ms']):>8} / {_f(r['loadgen_first_audio_ms']):<8}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
