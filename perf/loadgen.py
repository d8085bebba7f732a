# Async load generator for the OpenAI frontend, with vLLM-Omni's benchmark metrics and sweep:
# per concurrency level, factor x concurrency prompts kept `concurrency` in flight (as their
# --max-concurrency does), after a few warm-up requests; TTFT / TTFP / E2E / RTF per request, their
# mean / median / p99, and completed requests per second of wall time.
#
#   python -m perf.loadgen --url http://127.0.0.1:8091 --workload w1 --concurrency 1 16 64 --out results.json
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import socket
import sys
import time
from pathlib import Path

from perf import workloads
from perf.metrics import LevelResult, RequestRecord
from perf.progress import Progress
from perf.sse_client import stream_chat, trace_config

CHAT_PATH = "/v1/chat/completions"


def level_sizes(concurrency: list[int], factor: float, min_prompts: int = 1, fixed: int | None = None) -> list[int]:
    """Prompts per level: `fixed` when given, else factor x concurrency; at least min_prompts."""
    return [max(min_prompts, fixed if fixed else round(factor * c)) for c in concurrency]


def _session(concurrency: int, request_timeout: float):
    """One aiohttp session per level, as vLLM's benchmark client keeps one: its pool keeps a connection per
    stream alive between requests. (httpx's pool, tried first, stalled requests for up to ~0.4 s in a burst
    of 64: requests handed the same idle connection in one round retry each other in turn.)"""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=request_timeout)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[trace_config()])


async def run_level(
    url: str,
    workload: workloads.Workload,
    concurrency: int,
    num_prompts: int,
    *,
    offset: int = 0,
    timeout_s: float | None = None,
    request_timeout: float = 900.0,
    label: str | None = None,
) -> LevelResult:
    """num_prompts requests (prompts offset..), at most `concurrency` in flight. At timeout_s no new request
    starts and those in flight are cancelled (status `cut`), so a slow server still gives partial numbers."""
    records = [RequestRecord(index=offset + i) for i in range(num_prompts)]
    queue: asyncio.Queue = asyncio.Queue()
    for r in records:
        queue.put_nowait(r)
    progress = Progress(num_prompts, label or f"{workload.name} c={concurrency}")
    endpoint = url.rstrip("/") + CHAT_PATH

    async with _session(concurrency, request_timeout) as session:

        async def worker() -> None:
            while True:
                try:
                    record = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await stream_chat(session, endpoint, workload.body(record.index), record)
                progress.update(record.status == "ok")

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, num_prompts))]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    note = f"stopped by the {timeout_s:.0f}s level deadline" if pending else None
    progress.close(note or "")
    return LevelResult(concurrency, num_prompts, wall, records, note)


async def run_sweep(
    url: str,
    workload: workloads.Workload,
    concurrency: list[int],
    sizes: list[int],
    *,
    warmup: int = 5,
    level_timeouts: list[float | None] | None = None,
    warmup_timeout: float | None = None,
    request_timeout: float = 900.0,
    on_level=None,
) -> dict:
    """Warm-up, then one level per concurrency; returns the results dict (see results_json)."""
    level_timeouts = level_timeouts or [None] * len(concurrency)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = results_json(url, workload, started, concurrency, sizes, warmup)
    offset = 0
    if warmup > 0:
        level = await run_level(
            url,
            workload,
            warmup,
            warmup,
            timeout_s=warmup_timeout,
            request_timeout=request_timeout,
            label=f"{workload.name} warm-up",
        )
        s = level.summary()
        result["warmup"] = {
            k: s[k] for k in ("num_prompts", "completed", "failed", "cut_by_deadline", "wall_s", "errors")
        }
        offset = warmup
    for c, n, limit in zip(concurrency, sizes, level_timeouts):
        level = await run_level(url, workload, c, n, offset=offset, timeout_s=limit, request_timeout=request_timeout)
        offset += n
        entry = level.summary()
        entry["requests"] = [r.to_json() for r in level.records]
        result["levels"].append(entry)
        print(f"[{workload.name} c={c}] {_line(entry)}", file=sys.stderr, flush=True)
        if on_level is not None:
            on_level(result)
    return result


def results_json(url, workload, started, concurrency, sizes, warmup) -> dict:
    return {
        "tool": "perf.loadgen",
        "url": url,
        "client_host": socket.gethostname(),
        "started_at": started,
        "workload": workload.params(),
        "settings": {"concurrency": list(concurrency), "prompts_per_level": list(sizes), "warmup": warmup},
        "metrics": "vLLM-Omni definitions: TTFT first text delta, TTFP first audio chunk, E2E stream end, "
        "RTF (last audio chunk - start) / decoded audio seconds; throughput completed / level wall time",
        "warmup": None,
        "levels": [],
    }


def _fmt(stat: dict | None, key: str = "mean", unit: str = "", digits: int | None = None) -> str:
    digits = (0 if unit == "ms" else 3) if digits is None else digits
    return "-" if not stat else f"{stat[key]:.{digits}f}{unit}"


def _line(s: dict) -> str:
    rps = "-" if s["throughput_rps"] is None else f"{s['throughput_rps']:.3f}"
    return (
        f"done {s['completed']}/{s['num_prompts']} failed {s['failed']} cut {s['cut_by_deadline']} "
        f"in {s['wall_s']:.1f}s: {rps} req/s, TTFT {_fmt(s['ttft_ms'], unit='ms')}, "
        f"TTFP {_fmt(s['ttfp_ms'], unit='ms')} (p99 {_fmt(s['ttfp_ms'], 'p99', 'ms')}), "
        f"E2E {_fmt(s['e2e_ms'], unit='ms')}, RTF {_fmt(s['rtf'])}"
    )


def table(result: dict) -> str:
    head = "conc  prompts  done  fail  cut   req/s   TTFT ms  TTFP ms  TTFP p99   E2E ms    RTF  RTF p99"
    rows = [head]
    for s in result["levels"]:
        rps = "-" if s["throughput_rps"] is None else f"{s['throughput_rps']:.3f}"
        rows.append(
            f"{s['concurrency']:>4}  {s['num_prompts']:>7}  {s['completed']:>4}  {s['failed']:>4}  "
            f"{s['cut_by_deadline']:>3}  {rps:>6}  {_fmt(s['ttft_ms'], digits=1):>8}  "
            f"{_fmt(s['ttfp_ms'], digits=1):>7}  {_fmt(s['ttfp_ms'], 'p99', digits=1):>8}  "
            f"{_fmt(s['e2e_ms'], digits=1):>7}  {_fmt(s['rtf']):>5}  {_fmt(s['rtf'], 'p99'):>7}"
        )
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m perf.loadgen", description="OpenAI-frontend load generator (vLLM-Omni metrics)"
    )
    ap.add_argument("--url", default="http://127.0.0.1:8091", help="base URL of the OpenAI frontend")
    ap.add_argument("--workload", choices=tuple(workloads.BUILDERS), default="w1")
    ap.add_argument("--concurrency", type=int, nargs="+", help="levels (default: the workload's sweep)")
    ap.add_argument(
        "--prompts-per-level-factor", type=float, default=10.0, help="prompts per level = factor x concurrency"
    )
    ap.add_argument("--prompts-per-level", type=int, help="a fixed number of prompts per level instead")
    ap.add_argument("--min-prompts", type=int, default=1, help="at least this many prompts per level")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up requests before the sweep (sent together)")
    ap.add_argument("--level-timeout", type=float, help="seconds per level; then in-flight requests are cut")
    ap.add_argument("--request-timeout", type=float, default=900.0,
                    help="seconds a request may wait for its next bytes")
    ap.add_argument("--reply-tokens", type=int, help="override the workload's reply tokens (thinker max_tokens)")
    ap.add_argument("--frames", type=int, help="override the workload's codec frames (talker max_tokens)")
    ap.add_argument("--w2-prompt-tokens", type=int, default=2500, help="W2 prompt length")
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument("--plot", type=Path, help="PNG of the sweep (default: next to --out)")
    return ap.parse_args(argv)


def build_workload(args) -> workloads.Workload:
    kw = {"prompt_tokens": args.w2_prompt_tokens} if args.workload == "w2" else {}
    return workloads.build(args.workload, **kw).with_lengths(args.reply_tokens, args.frames)


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = build_workload(args)
    concurrency = args.concurrency or list(workload.concurrency)
    sizes = level_sizes(concurrency, args.prompts_per_level_factor, args.min_prompts, args.prompts_per_level)
    print(
        f"[loadgen] {workload.name}: {workload.reply_tokens} reply tokens, {workload.frames} frames, "
        f"~{workload.params()['prompt_tokens_mean']:.0f} text prompt tokens; levels {concurrency} "
        f"x prompts {sizes}; {args.warmup} warm-up",
        file=sys.stderr,
        flush=True,
    )

    def save(result: dict) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    timeouts = [args.level_timeout] * len(concurrency)
    result = asyncio.run(
        run_sweep(
            args.url,
            workload,
            concurrency,
            sizes,
            warmup=args.warmup,
            level_timeouts=timeouts,
            warmup_timeout=args.level_timeout,
            request_timeout=args.request_timeout,
            on_level=save,
        )
    )
    from perf.plot import plot_sweep

    png = args.plot or (args.out.with_suffix(".png") if args.out else None)
    if png:
        result["plot"] = plot_sweep({f"omnistage {workload.name}": result["levels"]}, png)
    save(result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
