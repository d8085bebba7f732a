# Long contexts beside many short streams, in one device call (run through perf/paged_ab.sh): the server on
# the full-size dummy weights, then
#   w1_64:  W1 at 64 streams (the sweep's top level, for the A/B against the static cache's run);
#   mixed:  64 W1 streams and, at the same time, 4 streams of LONG_TOKENS-token prompts of random text,
#           each answered as W2 is (900 reply tokens and frames: 72 s of audio);
#   alone:  one ALONE_TOKENS-token prompt, nothing else running, with a short reply (ALONE_REPLY).
# Every level has a deadline, and paged_ab.json is rewritten after each (stage metrics before and after
# each level: KV blocks in use, preemptions, requests waiting for blocks or rows; each GPU process's memory).
# A level whose deadline cut a request has every stub's thread stacks dumped at once (stacks.tar.gz).
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from omnistage.launch.proc_stats import dump_stub_stacks
from omnistage.launch.process import ProcessFailed
from perf import loadgen, workloads
from perf.bench_server import BenchServer
from perf.gpu_bench import add_model_args, gpu_processes, hardware, pack_stacks, parse_model_args, say, served_metrics
from perf.metrics import LevelResult

LONG_TOKENS = 30000
ALONE_TOKENS = 60000
# Reply tokens = codec frames. The long prompts' RTF (arrival to last audio over the audio's length) is read
# for W2's reply, the long-prompt workload of vLLM-Omni's DFX figures: a 5 s reply would measure the
# prefill of 30,000 tokens beside 64 streams against 5 s. The lone 60k prompt needs only to be served.
LONG_REPLY = 900
ALONE_REPLY = 64


def by_window(short: list[dict], longs: list[dict], width: float = 10.0) -> list[dict]:
    """The short requests that completed, grouped by when they started (windows of `width` s from the first
    long request's start): their mean TTFP and RTF, and the long requests' first tokens and ends that fall in
    each window, so that a window tells whether a long prompt was prefilling, decoding or done.
    Requests as the level's JSON records them (MetricsRecord.to_json())."""
    t0 = min(r["start"] for r in longs)
    done = [r for r in short if r["status"] == "ok" and r["rtf"] is not None]
    windows = []
    for k in range(int(max((r["start"] - t0 for r in done), default=-1) // width) + 1):
        lo, hi = k * width, (k + 1) * width
        rs = [r for r in done if lo <= r["start"] - t0 < hi]
        marks = lambda key: sorted(round(r["start"] - t0 + r[key], 1) for r in longs  # noqa: E731
                                   if r.get(key) is not None and lo <= r["start"] - t0 + r[key] < hi)
        windows.append({"from_s": lo, "requests": len(rs),
                        "ttfp_ms": round(1e3 * sum(r["ttfp"] for r in rs) / len(rs)) if rs else None,
                        "rtf": round(sum(r["rtf"] for r in rs) / len(rs), 3) if rs else None,
                        "long_first_tokens_s": marks("ttft"), "long_ends_s": marks("e2e")})  # fmt: skip
    return windows


def level(url: str, workload, concurrency: int, prompts: int, limit: float, offset: int = 0):
    return loadgen.run_level(url, workload, concurrency, prompts, offset=offset, timeout_s=limit)


class PagedAB:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = {"hardware": hardware(), "args": vars(args), "levels": {}}
        # each stub writes its stacks there on SIGUSR1 (omnistage/triton/logs.py)
        self.stacks = Path(os.environ.setdefault("OMNI_STACKS_DIR", tempfile.mkdtemp(prefix="paged_ab_stacks_")))
        self.deadline = time.monotonic() + args.budget_s

    def save(self) -> None:
        (self.out / "paged_ab.json").write_text(json.dumps(self.report, indent=1, default=str))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, name: str, results: dict, metrics_before: dict) -> None:
        entry = {part: r.summary() | {"requests": [x.to_json() for x in r.records]} for part, r in results.items()}
        entry["stage_metrics_before"] = metrics_before
        entry["stage_metrics_after"] = self.metrics()
        entry["gpu_processes_after"] = gpu_processes()
        if any(r.summary().get("cut_by_deadline") or r.summary().get("failed") for r in results.values()):
            # a stalled request's stubs, as soon as the level's deadline cut it (packed in finish())
            process = self.server.triton.process
            entry["stub_stacks_dumped"] = dump_stub_stacks(process.pid) if process and process.pid else 0
        self.report["levels"][name] = entry
        for part, r in results.items():
            say(f"{name}/{part}: {loadgen._line(r.summary())}")
        self.save()

    def metrics(self) -> dict:
        return served_metrics(self.server.triton.metrics_url)

    def healthy(self, limit: float = 90.0) -> dict:
        """Waits (at most `limit` s) for the frontend's /health to say every stage serves, so that a level
        after one that broke a stage (restarted meanwhile) measures the stack, not its restart. Returns
        what it saw: {"waited_s", "healthy"}."""
        t0 = time.monotonic()
        try:
            self.server.frontend.wait_http_ok(self.server.api_url + "/health", min(limit, max(0.0, self.left() - 60)))
        except ProcessFailed:
            return {"waited_s": round(time.monotonic() - t0, 1), "healthy": False}
        return {"waited_s": round(time.monotonic() - t0, 1), "healthy": True}

    def run(self) -> None:
        a = self.args
        tmp = Path(tempfile.mkdtemp(prefix="paged_ab_"))
        engine = {"max_seq_len": a.max_seq_len} if a.max_seq_len else {}
        b = a.port_base
        self.server = BenchServer(a.model, a.device, tmp / "server", engine=engine, http_port=b, grpc_port=b + 1,
                                  metrics_port=b + 2, api_port=b + 91)  # fmt: skip
        self.report["server"] = {n: s.parameters for n, s in self.server.spec.items()}
        t0 = time.monotonic()
        try:
            self.report["triton_ready_s"] = self.server.start(min(a.server_cap_s, self.left() - 60), progress=say)
        except Exception as exc:  # noqa: BLE001 - recorded, then the files are written
            self.report["server_start_failed"] = str(exc)[-2000:]
            return
        self.report["server_start_s"] = time.monotonic() - t0
        self.save()
        url = self.server.api_url
        w1 = workloads.w1(256).with_lengths(a.w1_reply_tokens, a.w1_frames)
        asyncio.run(level(url, w1, 5, 5, 40))  # warm-up
        before = self.metrics()
        self.record("w1_64", {"w1": asyncio.run(level(url, w1, 64, 64 * a.w1_factor, min(90, self.left() * 0.3)))},
                    before)  # fmt: skip
        if a.w1_only:
            return
        long = workloads.w2(4, prompt_tokens=LONG_TOKENS).with_lengths(LONG_REPLY, LONG_REPLY)
        alone = workloads.w2(1, seed=1, prompt_tokens=ALONE_TOKENS).with_lengths(ALONE_REPLY, ALONE_REPLY)
        limit = min(150, self.left() * 0.6)

        async def mixed():
            # W1 keeps 64 streams busy at least as long as the long prompts run (it has prompts for longer)
            short = asyncio.create_task(level(url, w1, 64, 64 * 40, limit, offset=64 * a.w1_factor))
            longs = await level(url, long, 4, 4, limit)
            ended = time.perf_counter()
            result = {"w1": await short, "long": longs}
            # the W1 requests that started and ended while the long ones ran: the figures the issue asks for
            during = [r for r in result["w1"].records if r.e2e is not None and r.start + r.e2e <= ended]
            result["w1_during_long"] = LevelResult(64, len(during), result["w1"].wall_s, during)
            return result

        self.report["health_before_mixed"] = self.healthy()
        before = self.metrics()
        self.record("mixed", asyncio.run(mixed()), before)
        entry = self.report["levels"]["mixed"]
        entry["w1_by_window"] = by_window(entry["w1"]["requests"], entry["long"]["requests"])
        self.save()
        self.report["health_before_alone"] = self.healthy()
        before = self.metrics()
        self.record("alone", {"long": asyncio.run(level(url, alone, 1, 1, max(30, self.left() - 20)))}, before)

    def finish(self) -> None:
        if any(lv.get("stub_stacks_dumped") for lv in self.report["levels"].values()):
            pack_stacks(self.stacks, self.out)
        if getattr(self, "server", None) is not None:
            (self.out / "server_log_tail.txt").write_text(self.server.log_tail(200))
            self.server.stop()
        self.save()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.paged_ab")
    ap.add_argument("--out", required=True)
    add_model_args(ap, "cpu: a dry run")
    ap.add_argument("--port-base", type=int, default=18200)
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("PERF_BUDGET_S", 330)))
    ap.add_argument("--server-cap-s", type=float, default=200.0)
    ap.add_argument("--max-seq-len", type=int, default=None, help="context per sequence; default: the profile's")
    ap.add_argument("--w1-factor", type=int, default=4, help="W1 prompts per stream at 64")
    ap.add_argument("--w1-reply-tokens", type=int, default=18)
    ap.add_argument("--w1-frames", type=int, default=46)
    ap.add_argument("--w1-only", action="store_true", help="W1 at 64 alone (the static cache's side of the A/B)")
    return parse_model_args(ap, argv)


def main(argv=None) -> int:
    bench = PagedAB(parse_args(argv))
    try:
        bench.run()
    finally:
        bench.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
