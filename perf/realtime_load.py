# Realtime load: N concurrent /v1/realtime sessions, each streaming an utterance at real-time pace (then
# silence, as an open microphone does) and listening to the spoken answer, for a few turns each.
# Per turn: the response latency from the end of speech (the audio position that speech_stopped reports,
# mapped to the wall time that audio was sent) to the first audio delta, playback underruns (a delta
# that arrives after the audio before it has finished playing at real-time pace, playback starting at the
# first delta), and the least lead of a delta over that playback. A turn fails when its
# response does not complete with audio, when an error event arrives, or when it takes over --turn-timeout.
#
#   python -m perf.realtime_load --url http://127.0.0.1:8091 --sessions 32 64 --turns 3 --out realtime.json
#   python -m perf.realtime_load --serve dummy:perf/qwen3_omni_30b_a3b_instruct.config.json --device cuda \
#       --sessions 32 64 --out $OUT/realtime.json      # starts tritonserver + frontend as gpu_bench does
from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RATE = 24000  # audio/pcm in and out
CHUNK_MS = 100  # one append per 100 ms of microphone audio
# dummy weights never stop on their own: forced lengths, as perf/workloads.py forces them (W1-like turns)
FORCED = [{"max_tokens": 16, "min_tokens": 16, "ignore_eos": True, "temperature": 0},
          {"max_tokens": 40, "min_tokens": 40, "ignore_eos": True}]  # fmt: skip


def speech_like(seconds: float, rate: int = RATE, f0: float = 140.0, seed: int = 0) -> np.ndarray:
    """A voiced-speech stand-in: harmonics of a wobbling pitch under three formant bumps, in syllables
    (4 Hz envelope), float32 at 0.3 peak. Voice activity detectors take it for speech."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = f0 * (1 + 0.05 * np.sin(2 * np.pi * 3 * t + rng.uniform(0, np.pi)))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    formants = ((700, 150), (1200, 200), (2600, 300))
    signal = np.zeros_like(t)
    for k in range(1, int(3500 / f0)):
        gain = sum(np.exp(-(((k * f0) - f) / bw) ** 2) for f, bw in formants) + 0.05
        signal += gain * np.sin(k * phase)
    signal *= 0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)
    return (0.3 * signal / np.abs(signal).max()).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return np.rint(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def load_utterance(path: str | None) -> bytes:
    if path is None:
        return pcm16(speech_like(1.5))
    import wave

    with wave.open(path) as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (RATE, 1, 2):
            raise SystemExit(f"{path}: need 24 kHz mono s16 WAV")
        return w.readframes(w.getnframes())


@dataclass
class Turn:
    latency_ms: float | None = None
    underruns: int = 0
    underrun_ms: float = 0.0
    # the least time any later delta arrived before the audio ahead of it finished playing (negative: the
    # worst underrun); None with a single delta. How much room the chunk schedule leaves.
    lead_ms: float | None = None
    audio_ms: float = 0.0
    status: str = "pending"  # completed | failed: <why>


@dataclass
class SessionLog:
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


class Mic:
    """Sends microphone audio at real-time pace and remembers when each audio position went out."""

    def __init__(self, ws):
        self.ws, self.sent_ms, self.start = ws, 0.0, time.perf_counter()
        self.chunk_ends: list[float] = []  # audio ms at the end of each chunk sent
        self.chunk_walls: list[float] = []  # the wall time each went out

    async def play(self, pcm: bytes) -> None:
        step = RATE * 2 * CHUNK_MS // 1000
        for i in range(0, len(pcm), step):
            due = self.start + self.sent_ms / 1000
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            chunk = pcm[i:i + step]
            wall = time.perf_counter()
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))
            self.sent_ms += len(chunk) / 2 / RATE * 1000
            self.chunk_ends.append(self.sent_ms)
            self.chunk_walls.append(wall)

    def wall_at(self, audio_ms: float) -> float:
        """The wall time the audio at position audio_ms went out: the send of the chunk that holds it, so no
        latency is counted before the server could have heard that audio."""
        i = bisect.bisect_right(self.chunk_ends, audio_ms)
        return self.chunk_walls[min(i, len(self.chunk_walls) - 1)]


async def run_session(url: str, utterance: bytes, turns: int, turn_timeout: float, api_key: str | None) -> SessionLog:
    import websockets

    log = SessionLog()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    silence = bytes(RATE * 2 * CHUNK_MS // 1000)
    try:
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "sampling_params_list": FORCED}}))
            mic = Mic(ws)
            events: asyncio.Queue = asyncio.Queue()

            async def reader():
                async for raw in ws:
                    events.put_nowait((time.perf_counter(), json.loads(raw)))

            async def quiet(stop: asyncio.Event):
                while not stop.is_set():
                    await mic.play(silence)

            read = asyncio.create_task(reader())
            try:
                for _ in range(turns):
                    turn = Turn()
                    log.turns.append(turn)
                    await mic.play(utterance)
                    stop = asyncio.Event()
                    background = asyncio.create_task(quiet(stop))
                    try:
                        await asyncio.wait_for(_listen(events, mic, turn), turn_timeout)
                    except asyncio.TimeoutError:
                        turn.status = "failed: timeout"
                    finally:
                        stop.set()
                        await background
                    if not turn.status.startswith("completed"):
                        break
                    await mic.play(silence * 5)  # the user listens a moment before the next turn
            finally:
                read.cancel()
    except Exception as exc:  # noqa: BLE001 - one session's failure is counted, not fatal
        log.error = f"{type(exc).__name__}: {exc}"
    return log


async def _listen(events: asyncio.Queue, mic: Mic, turn: Turn) -> None:
    end_of_speech = first = None
    played_ms = 0.0
    while True:
        at, event = await events.get()
        kind = event["type"]
        if kind == "error":
            turn.status = f"failed: {event['error'].get('code')}"
            return
        if kind == "input_audio_buffer.speech_stopped":
            end_of_speech = mic.wall_at(event["audio_end_ms"])
        elif kind == "response.output_audio.delta":
            ms = len(base64.b64decode(event["delta"])) / 2 / RATE * 1000
            if first is None:
                first = at
                turn.latency_ms = None if end_of_speech is None else (at - end_of_speech) * 1000
            else:
                lead = played_ms - (at - first) * 1000  # < 0: the audio before it has finished playing
                turn.lead_ms = lead if turn.lead_ms is None else min(turn.lead_ms, lead)
                if lead < 0:
                    turn.underruns += 1
                    turn.underrun_ms -= lead
                    first = at - played_ms / 1000  # playback resumes from here
            played_ms += ms
        elif kind == "response.done":
            status = event["response"]["status"]
            turn.audio_ms = played_ms
            turn.status = "completed" if status == "completed" and played_ms > 0 else f"failed: {status}"
            return


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(sessions: int, logs: list[SessionLog], wall_s: float) -> dict:
    turns = [t for log in logs for t in log.turns]
    done = [t for t in turns if t.status == "completed"]
    lat = [t.latency_ms for t in done if t.latency_ms is not None]
    leads = [t.lead_ms for t in done if t.lead_ms is not None]
    failures: dict[str, int] = {}
    for t in turns:
        if t.status != "completed":
            failures[t.status] = failures.get(t.status, 0) + 1
    for log in logs:
        if log.error:
            failures[log.error[:120]] = failures.get(log.error[:120], 0) + 1
    return {
        "sessions": sessions, "turns": len(turns), "completed_turns": len(done), "failed_turns": len(turns) - len(done),
        "session_errors": sum(1 for log in logs if log.error), "failures": failures, "wall_s": round(wall_s, 1),
        "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                       "mean": statistics.fmean(lat) if lat else None, "max": max(lat) if lat else None},
        "underruns": sum(t.underruns for t in done), "underrun_ms": round(sum(t.underrun_ms for t in done), 1),
        "turns_with_underruns": sum(1 for t in done if t.underruns),
        # per turn its least lead (Turn.lead_ms); p1 near 0 says the schedule has no room left
        "lead_ms": {"p1": percentile(leads, 1), "p10": percentile(leads, 10), "p50": percentile(leads, 50),
                    "min": min(leads) if leads else None},
    }  # fmt: skip


async def run_level(url: str, sessions: int, turns: int, utterance: bytes, turn_timeout: float,
                    api_key: str | None = None) -> dict:  # fmt: skip
    t0 = time.perf_counter()
    # sessions start over one utterance's time, as people do not all start speaking on the same 100 ms
    async def staggered(i: int) -> SessionLog:
        await asyncio.sleep(i * len(utterance) / 2 / RATE / sessions)
        return await run_session(url, utterance, turns, turn_timeout, api_key)

    logs = await asyncio.gather(*(staggered(i) for i in range(sessions)))
    return summarize(sessions, logs, time.perf_counter() - t0)


def ws_url(http_url: str, model: str | None) -> str:
    url = http_url.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + "/v1/realtime"
    return f"{url}?model={model}" if model else url


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.realtime_load", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8091", help="the frontend (ignored with --serve)")
    ap.add_argument("--serve", metavar="MODEL", help="start tritonserver + frontend for MODEL (perf.bench_server)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--max-seq-len", type=int, default=3584)
    ap.add_argument("--sessions", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--utterance", help="24 kHz mono s16 WAV (default: 1.5 s of synthesized voiced speech)")
    ap.add_argument("--turn-timeout", type=float, default=30.0)
    ap.add_argument("--warmup", type=int, default=2, help="turns of one session before the levels (0: none)")
    ap.add_argument("--api-key")
    ap.add_argument("--out", type=Path, default=Path("realtime_load.json"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    utterance = load_utterance(args.utterance)
    server = None
    url = args.url
    if args.serve:
        from perf.bench_server import BenchServer

        server = BenchServer(args.serve, args.device, Path(".run/perf_realtime"),
                             engine={"max_seq_len": args.max_seq_len}, api_port=18491, http_port=18480,
                             grpc_port=18481, metrics_port=18482)  # fmt: skip
        server.start(ready_timeout=600)
        url = server.api_url
    results = {"utterance_s": len(utterance) / 2 / RATE, "turns_per_session": args.turns, "levels": []}
    try:
        if args.warmup:  # first requests pay for lazy initialisation (allocations, kernels): kept apart
            results["warmup"] = asyncio.run(run_level(ws_url(url, None), 1, args.warmup, utterance, args.turn_timeout,
                                                      args.api_key))  # fmt: skip
        for n in args.sessions:
            print(f"[realtime_load] {n} sessions x {args.turns} turns", flush=True)
            level = asyncio.run(run_level(ws_url(url, None), n, args.turns, utterance, args.turn_timeout, args.api_key))
            results["levels"].append(level)
            print(json.dumps(level), flush=True)
            args.out.write_text(json.dumps(results, indent=1))
    finally:
        if server is not None:
            if any(level["failed_turns"] for level in results["levels"]):
                results["server_log_tail"] = server.log_tail(120)
                args.out.write_text(json.dumps(results, indent=1))
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
