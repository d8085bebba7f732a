# Fault-injection soak: a mixed load on the OpenAI frontend (perf/soak.py's requests) while every stage's
# stub process is killed (SIGKILL) and stopped (SIGSTOP, left stopped: a hang), each twice in a row. For
# every request it records how it ended: completed, failed cleanly (an HTTP error with an OpenAI error
# body, or an error event and the end of the stream), left by the client on purpose, hung (open after
# HUNG_AFTER_S) or broken (a cut connection, a stream without its end); for every fault the time until
# the stage serves again (a new stub and /health 200) and until the requests it hit ended; and the
# processes, threads, fds, shared-memory segments and RSS of tritonserver (with its stubs) and of the
# frontend before and after, with the stages' gauges (slots, waiting, pending responses) back at 0. "After"
# is once every instance a reload replaced is gone: unloaded, or cleared by the launcher's restart of
# tritonserver (workarounds.py, 9), whose count and time it reports too.
#
#   python -m perf.fault_soak --model checkpoints/tiny --concurrency 32 --out fault_soak.json
#   python -m perf.fault_soak --model dummy:perf/qwen3_omni_30b_a3b_instruct.config.json --device cuda \
#       --concurrency 32 --duration 600 --out $OUT/fault_soak.json     # load for at least 600 s
#
# run_fault_soak() is what the CI test calls with a few faults (tests/triton/test_fault_recovery.py).
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from omnistage.launch.proc_stats import children, process_state, stub_pids, tree_stats
from omnistage.triton.workarounds import stale_stubs
from perf.soak import CheckedRun, _body, _post_or_leave, _gauges, _idle, _wait, growth, soak_server
from perf.soak_inputs import tiny_wav_b64

HUNG_AFTER_S = 180.0  # a request open this long counts as hung (a reload on the GPU takes a minute or more)
STAGES = ("thinker", "talker", "code2wav", "omni_ensemble")
SIGNALS = ("SIGKILL", "SIGSTOP")


@dataclass
class Fault:
    model: str
    signal: str
    pid: int = 0
    at: float = 0.0  # monotonic
    recovered_s: float | None = None  # until a new stub runs and /health is 200 again
    requests_hit: int = 0  # requests open at the fault that then failed
    hit_ended_s: float | None = None  # until the last of those ended


@dataclass
class FaultSoakResult(CheckedRun):
    concurrency: int = 0
    requests: int = 0
    outcomes: dict = field(default_factory=dict)  # completed / failed_cleanly / client_left / hung / broken
    statuses: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # "<status> <error message's first 80 chars>" -> count
    faults: list = field(default_factory=list)
    server_restarts: int = 0  # by TritonServer, when reloads left too many instances behind
    cleared_after_s: float | None = None  # from the load's end until no replaced instance was left


def rss_mb(pid: int) -> float:
    total = 0
    for p in (pid, *children(pid)):
        try:
            total += next(int(line.split()[1]) for line in open(f"/proc/{p}/status") if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return round(total / 1024, 1)


def zombies(pid: int) -> int:
    """Exited children not reaped by their parent (tritonserver never reaps a stub it lost, workarounds.py 9)."""
    return sum(process_state(p)["state"] == "Z" for p in children(pid))


def stats(triton_pid: int, frontend_pid: int) -> dict:
    triton = tree_stats(triton_pid)
    dead = zombies(triton_pid)
    return {"triton": triton | {"processes": triton["processes"] - dead, "zombies": dead, "rss_mb": rss_mb(triton_pid)},
            "frontend": tree_stats(frontend_pid) | {"rss_mb": rss_mb(frontend_pid)}}  # fmt: skip


async def _request(http: httpx.AsyncClient, body: dict, leave_after: int | None) -> tuple[str, int | str, str]:
    """(outcome, status, error message)"""
    if not body["stream"]:
        r = await _post_or_leave(http, body, leave_after)
        if r is None:
            return "client_left", 0, ""
        if r.status_code == 200:
            return "completed", 200, ""
        try:
            return "failed_cleanly", r.status_code, r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return "broken", r.status_code, r.text[:80]
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            try:
                return "failed_cleanly", r.status_code, r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return "broken", r.status_code, r.text[:80]
        events, error = 0, ""
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            if line.startswith('data: {"error"'):
                error = json.loads(line[6:])["error"]["message"]
            if line == "data: [DONE]":
                return ("failed_cleanly" if error else "completed"), 200, error
            if leave_after is not None and events >= leave_after:
                return "client_left", 200, ""
        return ("failed_cleanly" if error else "broken"), 200, error or "the stream ended without [DONE]"


async def _load(api_url: str, concurrency: int, stop: threading.Event, cancel_fraction: float, seed: int,
                log: list) -> None:  # fmt: skip
    rng, wav = random.Random(seed), tiny_wav_b64()

    async def worker(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body, _ = _body(rng, wav)
            leave = rng.choice([1, 3, 8]) if rng.random() < cancel_fraction else None
            start = time.monotonic()
            try:
                outcome, status, error = await asyncio.wait_for(_request(http, body, leave), HUNG_AFTER_S)
            except asyncio.TimeoutError:
                outcome, status, error = "hung", 0, ""
            except httpx.HTTPError as e:
                outcome, status, error = "broken", type(e).__name__, str(e)[:80]
            log.append((start, time.monotonic(), outcome, status, error))
            if outcome == "failed_cleanly":
                await asyncio.sleep(0.5)  # a client honouring Retry-After, roughly: no busy loop of refusals

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=api_url, timeout=HUNG_AFTER_S + 10, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


def _cleared(server_pid: int) -> bool:
    """No stub of a replaced instance left: none dead and unreaped, none with a newer stub for its instance."""
    return not zombies(server_pid) and not stale_stubs(server_pid, grace_s=0)


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def inject(api_url: str, server_pid: Callable[[], int], fault: Fault, recover_timeout_s: float) -> None:
    """Signals the model's stub and waits until a new stub serves (new pid, /health 200)."""
    _wait(lambda: _healthy(api_url), recover_timeout_s)
    before = set(stub_pids(server_pid())[fault.model])
    fault.pid = max(before)  # the newest: a stale one may linger a while (workarounds.py, 9)
    fault.at = time.monotonic()
    os.kill(fault.pid, getattr(signal, fault.signal))

    def back() -> bool:
        return bool(set(stub_pids(server_pid()).get(fault.model, [])) - before) and _healthy(api_url)

    waited = _wait(back, recover_timeout_s)
    fault.recovered_s = None if waited is None else round(time.monotonic() - fault.at, 1)


def run_fault_soak(api_url: str, metrics_url: str, server_pid: Callable[[], int], frontend_pid: int, *, concurrency: int = 32,
                   faults: list[tuple[str, str]] | None = None, min_duration_s: float = 0.0, warmup_s: float = 10.0,
                   settle_s: float = 5.0, recover_timeout_s: float = 300.0, cancel_fraction: float = 0.1,
                   seed: int = 0, thread_slack: int = 16, fd_slack: int = 16,
                   clear_timeout_s: float = 600.0) -> FaultSoakResult:  # fmt: skip
    """faults: (model, signal) in order; default every stage, SIGKILL then SIGSTOP, each twice in a row.
    server_pid: tritonserver's pid now (TritonServer restarts it when reloads leave too much behind).
    clear_timeout_s: how long after the load the replaced instances may take to go (the launcher's restart
    comes once enough of them exist or one has for a while: TritonServer.stale_restart_s)."""
    faults = faults or [(m, s) for m in STAGES for s in SIGNALS for _ in range(2)]
    result = FaultSoakResult(concurrency=concurrency, faults=[Fault(m, s) for m, s in faults])
    stop, log = threading.Event(), []
    warm = threading.Timer(warmup_s, stop.set)
    warm.start()
    asyncio.run(_load(api_url, concurrency, stop, cancel_fraction, seed + 1, []))
    _wait(lambda: _idle(metrics_url), 60)
    result.before = stats(server_pid(), frontend_pid)
    pids = {server_pid()}

    def driver() -> None:
        started = time.monotonic()
        try:
            time.sleep(settle_s)
            for fault in result.faults:
                inject(api_url, server_pid, fault, recover_timeout_s)
                pids.add(server_pid())
                time.sleep(settle_s)  # requests served again between faults
            time.sleep(max(0.0, min_duration_s - (time.monotonic() - started)))
        finally:
            stop.set()

    stop.clear()
    faults_thread = threading.Thread(target=driver, name="faults", daemon=True)
    faults_thread.start()
    asyncio.run(_load(api_url, concurrency, stop, cancel_fraction, seed, log))
    faults_thread.join()
    result.cleared_after_s = _wait(lambda: _cleared(server_pid()) and _healthy(api_url), clear_timeout_s)
    result.idle_after_s = _wait(lambda: _idle(metrics_url), 60)
    time.sleep(3.0)  # finished threads exit, idle pool threads too (core/daemon_pool.py: 1 s)
    result.after = stats(server_pid(), frontend_pid)
    result.server_restarts = len(pids | {server_pid()}) - 1
    result.after["gauges"] = {k: v for k, v in _gauges(metrics_url).items() if v and k.endswith(
        ("slots_in_use", "requests_waiting", "responses_pending", "requests_in_flight", "pending_request_count"))}
    _summarize(result, log, thread_slack, fd_slack)
    return result


def _summarize(result: FaultSoakResult, log: list, thread_slack: int, fd_slack: int) -> None:
    result.requests = len(log)
    result.outcomes = dict(Counter(outcome for _, _, outcome, _, _ in log))
    result.statuses = {str(k): v for k, v in Counter(status for *_, status, _ in log).items()}
    result.errors = dict(Counter(f"{status} {error[:80]}" for *_, status, error in log if error).most_common(12))
    for fault in result.faults:
        hit = [end for start, end, outcome, _, _ in log if start < fault.at < end and outcome == "failed_cleanly"]
        fault.requests_hit = len(hit)
        fault.hit_ended_s = round(max(hit) - fault.at, 1) if hit else None
    p = result.problems
    for bad in ("hung", "broken"):
        if result.outcomes.get(bad):
            p.append(f"{result.outcomes[bad]} requests {bad}")
    server_errors = {k: v for k, v in result.statuses.items() if k.isdigit() and int(k) >= 500 and k != "503"}
    if server_errors:  # a fault is the server's outage: 503, retryable, never a 500
        p.append(f"answered with server errors other than 503: {server_errors}")
    if not result.outcomes.get("completed"):
        p.append("no request completed")
    for fault in result.faults:
        if fault.recovered_s is None:
            p.append(f"{fault.model} did not recover after {fault.signal}")
    if result.cleared_after_s is None:
        p.append(f"instances replaced by reloads still there after the load: {result.after['triton']}")
    if result.idle_after_s is None or result.after["gauges"]:
        p.append(f"not idle after the load: {result.after['gauges']}")
    p += growth(result.before, result.after, thread_slack, fd_slack)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.fault_soak", description=__doc__)
    ap.add_argument("--model", default="checkpoints/tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=0.0, help="keep the load on at least this long (seconds)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated models to fault")
    ap.add_argument("--repeat", type=int, default=2, help="faults of each kind per stage, in a row")
    ap.add_argument("--run-dir", type=Path, default=Path(".run/fault_soak"))
    ap.add_argument("--first-port", type=int, default=None, help="Triton HTTP, gRPC, metrics, API on 4 ports from here")
    ap.add_argument("--out", type=Path, default=Path("fault_soak.json"))
    args = ap.parse_args(argv)
    server = soak_server(args.model, args.device, args.run_dir, args.first_port)
    faults = [(m, s) for m in args.stages.split(",") for s in SIGNALS for _ in range(args.repeat)]
    report: dict = {"command": " ".join(["python -m perf.fault_soak", *(argv or sys.argv[1:])])}
    try:
        server.start(900)
        t0 = time.monotonic()
        result = run_fault_soak(server.api_url, server.triton.metrics_url, lambda: server.triton.process.pid,
                                server.frontend.pid, concurrency=args.concurrency, faults=faults,
                                min_duration_s=args.duration)  # fmt: skip
        report["fault_soak"] = asdict(result) | {"ok": result.ok, "wall_s": round(time.monotonic() - t0, 1)}
    finally:
        server.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    return 0 if report.get("fault_soak", {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
