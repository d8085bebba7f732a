# Soak and fault script: a bounded mixed load on the OpenAI frontend (streamed and not, text and spoken
# replies, text and audio prompts, long chats, clients that leave at random points), then checks that every
# request ended (no hang, no 5xx) and that nothing grew: the stages' KV slots and open response streams,
# Triton's pending requests, the threads / file descriptors / shared-memory segments of tritonserver (with
# its stubs) and of the frontend. With --sample-every, the RSS and threads of each process (every stub by
# its instance) over the whole run, and whether each levelled off after the warm-up (perf/proc_sampler.py).
# Optional phases: bad inputs (each must be a 4xx, the server healthy after) and a killed stage process
# (its requests end with an error, /health goes 503 and comes back).
#
#   python -m perf.soak --model checkpoints/tiny --duration 300 --concurrency 32 --faults --out soak.json
#   python -m perf.soak --model checkpoints/tiny --duration 720 --concurrency 16 --warmup 120 --sample-every 15
#
# run_soak() is also what the CI test (tests/triton/test_reliability.py) calls, for 20 seconds.
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from omnistage.launch.proc_stats import stub_pids, tree_stats
from perf.proc_sampler import ProcSampler, levelling
from perf.soak_inputs import BAD_INPUTS, WORDS, spoken_prompt, tiny_wav_b64

HUNG_AFTER_S = 120.0  # a request still open after this counts as hung
IDLE_GAUGES = ("slots_in_use", "requests_waiting", "responses_pending")


@dataclass
class CheckedRun:
    """What every soak records beside its counts: the server idle again, process stats before and after, and
    each check that failed (ok: none did)."""

    idle_after_s: float | None = None
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class SoakResult(CheckedRun):
    duration_s: float = 0.0
    concurrency: int = 0
    requests: int = 0
    completed: int = 0
    cancelled_by_client: int = 0
    hung: int = 0
    statuses: dict = field(default_factory=dict)
    in_stream_errors: list = field(default_factory=list)
    kinds: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)  # per process RSS and threads over time (perf/proc_sampler.py)
    levelling: dict = field(default_factory=dict)


def _gauges(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, value in re.findall(r"^(omni_\w+?|nv_inference_pending_request_count)\{[^}]*\} (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _idle(metrics_url: str) -> bool:
    g = _gauges(metrics_url)
    busy = [k for k, v in g.items() if v and (k.endswith(IDLE_GAUGES) or k == "nv_inference_pending_request_count")]
    return not busy


def snapshot(metrics_url: str, triton_pid: int, frontend_pid: int) -> dict:
    g = _gauges(metrics_url)
    kept = {k: v for k, v in g.items() if k.endswith(IDLE_GAUGES) or k == "nv_inference_pending_request_count"}
    return {"triton": tree_stats(triton_pid), "frontend": tree_stats(frontend_pid), "gauges": kept}


def _long_chat(rng: random.Random, words: int) -> list[dict]:
    """Earlier turns of a chat, about `words` tokens in all (one token per word of WORDS)."""
    turns = []
    for i in range(6):
        turns.append({"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choices(WORDS, k=words // 6))})
    return turns


def _body(rng: random.Random, wav: str, long_chat_words: int = 0) -> tuple[dict, str]:
    stream, spoken, audio_in = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.3
    long_chat = long_chat_words > 0 and not audio_in and rng.random() < 0.3
    content = spoken_prompt(rng) if not audio_in else [
        {"type": "text", "text": "Repeat this."}, {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    frames = rng.randint(4, 30)
    history = _long_chat(rng, long_chat_words) if long_chat else []
    body = {"messages": history + [{"role": "user", "content": content}], "max_tokens": rng.randint(2, 24),
            "modalities": ["text", "audio"] if spoken else ["text"], "stream": stream,
            "sampling_params_list": [{"temperature": 0.7, "ignore_eos": True},
                                     {"max_tokens": frames, "ignore_eos": True}]}  # fmt: skip
    prompt = "audio" if audio_in else "long-chat" if long_chat else "text"
    kind = f"{'stream' if stream else 'json'}/{'audio' if spoken else 'text'}-out/{prompt}-in"
    return body, kind


async def _post_or_leave(http: httpx.AsyncClient, body: dict, leave_after: int | None):
    """A non-streamed chat request; None when the client left after leave_after tenths of a second."""
    task = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
    done, _ = await asyncio.wait({task}, timeout=None if leave_after is None else leave_after / 10)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _one(http: httpx.AsyncClient, body: dict, leave_after: int | None, result: SoakResult) -> None:
    """One request; leave_after: close the connection after that many SSE events (or, not streamed, after
    that many tenths of a second), like a client that goes away."""
    if not body["stream"]:
        r = await _post_or_leave(http, body, leave_after)
        if r is None:
            result.cancelled_by_client += 1
            return
        result.statuses[r.status_code] = result.statuses.get(r.status_code, 0) + 1
        result.completed += r.status_code == 200
        return
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        result.statuses[r.status_code] = result.statuses.get(r.status_code, 0) + 1
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            if line.startswith('data: {"error"'):
                result.in_stream_errors.append(json.loads(line[6:])["error"]["message"])
            if line == "data: [DONE]":
                result.completed += r.status_code == 200
                return
            if leave_after is not None and events >= leave_after:
                result.cancelled_by_client += 1
                return


async def load(api_url: str, duration_s: float, concurrency: int, cancel_fraction: float, seed: int,
               long_chat_words: int = 0) -> SoakResult:  # fmt: skip
    result = SoakResult(duration_s=duration_s, concurrency=concurrency)
    rng, wav, kinds = random.Random(seed), tiny_wav_b64(), Counter()
    deadline = time.monotonic() + duration_s

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            body, kind = _body(rng, wav, long_chat_words)
            leave = rng.choice([1, 2, 3, 8, 20]) if rng.random() < cancel_fraction else None
            kinds[kind] += 1
            result.requests += 1
            try:
                await asyncio.wait_for(_one(http, body, leave, result), HUNG_AFTER_S)
            except asyncio.TimeoutError:
                result.hung += 1
            except httpx.HTTPError as e:  # the server closed on us: as bad as a 5xx
                result.statuses[type(e).__name__] = result.statuses.get(type(e).__name__, 0) + 1

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=api_url, timeout=HUNG_AFTER_S + 10, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    result.kinds = dict(kinds)
    return result


def run_soak(api_url: str, metrics_url: str, triton_pid: int, frontend_pid: int, *, duration_s: float = 300,
             concurrency: int = 32, cancel_fraction: float = 0.25, seed: int = 0, warmup_s: float = 10,
             thread_slack: int = 16, fd_slack: int = 16, long_chat_words: int = 0,
             sample_every_s: float | None = None) -> SoakResult:  # fmt: skip
    """Warm-up at full concurrency (lazily grown pools fill), snapshot, the soak, wait idle, snapshot.
    sample_every_s: sample each process's RSS and threads from the warm-up on (SoakResult.samples), and check
    that each levelled off after it."""
    sampler = ProcSampler(lambda: triton_pid, frontend_pid, sample_every_s).start() if sample_every_s else None
    asyncio.run(load(api_url, warmup_s, concurrency, cancel_fraction, seed + 1, long_chat_words))
    warm_s = sampler.elapsed() if sampler else 0.0
    _wait(lambda: _idle(metrics_url), 30)
    before = snapshot(metrics_url, triton_pid, frontend_pid)
    result = asyncio.run(load(api_url, duration_s, concurrency, cancel_fraction, seed, long_chat_words))
    result.idle_after_s = _wait(lambda: _idle(metrics_url), 30)
    time.sleep(2.0)  # let finished threads exit, idle pool threads too (omnistage/core/daemon_pool.py: 1 s)
    result.before, result.after = before, snapshot(metrics_url, triton_pid, frontend_pid)
    p = result.problems
    if sampler is not None:
        result.samples = sampler.stop()
        result.levelling = levelling(result.samples, warm_s)
        p += [f"{name} did not level off: {v}" for name, v in result.levelling.items() if not v["levels_off"]]
    if result.hung:
        p.append(f"{result.hung} requests hung (open after {HUNG_AFTER_S:.0f}s)")
    bad = {k: v for k, v in result.statuses.items() if not isinstance(k, int) or k >= 500}
    if bad:
        p.append(f"server errors: {bad}")
    if result.in_stream_errors:
        p.append(f"{len(result.in_stream_errors)} in-stream errors, e.g. {result.in_stream_errors[0]}")
    if result.idle_after_s is None:
        p.append(f"stages not idle 30s after the load: {result.after['gauges']}")
    p += growth(result.before, result.after, thread_slack, fd_slack)
    return result


def growth(before: dict, after: dict, thread_slack: int, fd_slack: int) -> list[str]:
    """What grew between two snapshots of tritonserver's and the frontend's process trees, beyond the slack."""
    grew = []
    for proc in ("triton", "frontend"):
        b, a = before[proc], after[proc]
        for key, slack in (("threads", thread_slack), ("fds", fd_slack), ("shm_segments", 0), ("processes", 0)):
            if a[key] > b[key] + slack:
                grew.append(f"{proc} {key} grew {b[key]} -> {a[key]}")
    return grew


def _wait(predicate, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return round(time.monotonic() - start, 3)
        time.sleep(0.1)
    return None


def bad_inputs(api_url: str) -> dict:
    """Every bad input must be answered 4xx; the server is healthy after all of them."""
    answers = {}
    with httpx.Client(base_url=api_url, timeout=120) as http:
        for name, (content, headers) in BAD_INPUTS.items():
            r = http.post("/v1/chat/completions", content=content(), headers=headers)
            answers[name] = r.status_code
        healthy = http.get("/health").status_code == 200
    return {"answers": answers, "all_4xx": all(400 <= s < 500 for s in answers.values()), "healthy_after": healthy}


def kill_stage(api_url: str, triton_pid: int, model: str = "talker") -> dict:
    """Kill a stage's stub while a spoken reply streams; report how the request ended and the recovery."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300, "stream": True,
            "modalities": ["text", "audio"], "sampling_params_list": [{"ignore_eos": True}, {"max_tokens": 250, "ignore_eos": True}]}  # fmt: skip
    victim = stub_pids(triton_pid)[model][0]
    out: dict = {"model": model, "pid": victim}
    with httpx.Client(base_url=api_url, timeout=60) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        events, last = 0, ""
        for line in r.iter_lines():
            if line.startswith("data:"):
                events += 1
                last = line if line != "data: [DONE]" else last  # the event before [DONE]: the error
                if events == 3:
                    signal_time = time.monotonic()
                    os.kill(victim, signal.SIGKILL)
        out["request_ended_s"] = round(time.monotonic() - signal_time, 2)
        out["ended_with"] = last[:200]
    with httpx.Client(base_url=api_url, timeout=10) as http:
        out["health_503"] = _wait(lambda: http.get("/health").status_code == 503, 10) is not None
        out["healthy_again_s"] = _wait(lambda: http.get("/health").status_code == 200, 120)
        ok = http.post("/v1/chat/completions", json=dict(body, stream=False, max_tokens=3), timeout=120)
        out["served_after"] = ok.status_code
    return out


def soak_server(model: str, device: str, run_dir: Path, first_port: int | None = None):
    """tritonserver and the frontend for a soak, on free ports or on the four from first_port (not started)."""
    from omnistage.launch.process import free_ports
    from perf.bench_server import BenchServer

    ports = free_ports(4) if first_port is None else range(first_port, first_port + 4)
    http_port, grpc_port, metrics_port, api_port = ports
    return BenchServer(model, device, run_dir, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                       api_port=api_port)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__)
    ap.add_argument("--model", default="checkpoints/tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cancel-fraction", type=float, default=0.25)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the soak's snapshot")
    ap.add_argument("--long-chat-words", type=int, default=0,
                    help="a share of the text prompts carry earlier turns of about this many tokens (0: none)")
    ap.add_argument("--sample-every", type=float, default=None,
                    help="seconds between samples of each process's RSS and threads (and check they level off)")
    ap.add_argument("--faults", action="store_true", help="then bad inputs and a killed talker stub")
    ap.add_argument("--run-dir", type=Path, default=Path(".run/soak"))
    ap.add_argument("--first-port", type=int, default=None, help="Triton HTTP, gRPC, metrics, API on 4 ports from here")
    ap.add_argument("--out", type=Path, default=Path("soak.json"))
    args = ap.parse_args(argv)
    server = soak_server(args.model, args.device, args.run_dir, args.first_port)
    report: dict = {"command": " ".join(["python -m perf.soak", *(argv or sys.argv[1:])])}
    try:
        server.start(900)
        t0 = time.monotonic()
        result = run_soak(server.api_url, server.triton.metrics_url, server.triton.process.pid, server.frontend.pid,
                          duration_s=args.duration, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
                          warmup_s=args.warmup, long_chat_words=args.long_chat_words, sample_every_s=args.sample_every)  # fmt: skip
        report["soak"] = asdict(result) | {"ok": result.ok, "wall_s": round(time.monotonic() - t0, 1)}
        if args.faults:
            report["bad_inputs"] = bad_inputs(server.api_url)
            report["kill_stage"] = kill_stage(server.api_url, server.triton.process.pid)
    finally:
        server.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    shown = dict(report, soak={k: v for k, v in report.get("soak", {}).items() if k != "samples"})  # those: in --out
    print(json.dumps(shown, indent=2, default=str))
    return 0 if report.get("soak", {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
