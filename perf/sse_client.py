# One streamed chat completion against the OpenAI frontend, timed the way vLLM-Omni's benchmark client
# times it (aiohttp, one session per level): the clock starts just before the POST; every SSE event is
# stamped when the bytes that complete it arrive.
from __future__ import annotations

import asyncio
import base64
import json
import time

from perf.metrics import RequestRecord

DONE = "[DONE]"


def apply_event(record: RequestRecord, data: str, t: float) -> bool:
    """Updates record from one SSE `data:` payload that arrived t seconds after the start.

    Returns True when the stream is over ([DONE] or an in-stream error event)."""
    if data == DONE:
        return True
    event = json.loads(data)
    if "error" in event:  # the frontend's in-stream error: {"error": {...}} then [DONE]
        err = event["error"]
        record.status, record.error = (
            "error",
            f"stream error: {err.get('message', err) if isinstance(err, dict) else err}",
        )
        return True
    if record.id is None and event.get("id"):
        record.id = event["id"]
    if event.get("usage"):
        usage = event["usage"]
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        record.audio_frames = (usage.get("completion_tokens_details") or {}).get("audio_tokens")
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        audio = delta.get("audio") or {}
        # the reply text: `content`, or with audio on (OpenAI's shape) the audio's `transcript`
        if delta.get("content") or audio.get("transcript"):
            record.text_chunks += 1
            if record.ttft is None:
                record.ttft = t
        if audio.get("data"):
            record.audio_samples += len(base64.b64decode(audio["data"])) // 2  # pcm16 mono
            record.audio_chunks += 1
            record.last_audio = t
            if record.ttfp is None:
                record.ttfp = t
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    return False


def _data(line: str) -> str | None:
    # SSE: `data: <payload>`; comments (`:`), other fields and blank separators carry nothing for us
    if not line.startswith("data:"):
        return None
    return line[5:].lstrip(" ")


class LineSplitter:
    """Bytes as they arrive -> complete lines (without their \\n or \\r\\n). An audio event is one line of
    some 130 KB of base64 per 25 frames (more where the server merged chunks), so a line has no length cap
    and its pieces are joined once, when its end arrives."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def feed(self, data: bytes) -> list[str]:
        self._pieces.append(data)
        if b"\n" not in data:
            return []
        lines = b"".join(self._pieces).split(b"\n")
        self._pieces = [lines.pop()]
        return [line.rstrip(b"\r").decode("utf-8") for line in lines]


def trace_config():
    """aiohttp tracing that stamps when a request was written (record.sent), for perf/trace_join.py: the
    session's requests pass their RequestRecord as trace_request_ctx."""
    import aiohttp

    async def sent(session, ctx, params) -> None:
        record = ctx.trace_request_ctx
        record.sent = time.perf_counter() - record.start

    config = aiohttp.TraceConfig()
    config.on_request_chunk_sent.append(sent)
    return config


async def stream_chat(
    session, url: str, body: dict, record: RequestRecord, audio_expected: bool = True
) -> RequestRecord:
    """POSTs body (stream: true) on an aiohttp session and fills record; never raises except CancelledError
    (marked `cut`). The body is read to its end after [DONE], as the OpenAI SDK does, so that the connection
    goes back to the session's pool instead of a new one being opened for the next request (a connect per
    request cost up to tens of ms of each TTFT at 64 streams)."""
    record.start = time.perf_counter()
    ended = False
    try:
        async with session.post(url, json=body, trace_request_ctx=record) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                record.status, record.error = "error", f"HTTP {response.status}: {text[:300]}"
                record.e2e = time.perf_counter() - record.start
                return record
            lines = LineSplitter()
            async for data in response.content.iter_any():
                now = time.perf_counter() - record.start
                for line in lines.feed(data):
                    payload = _data(line)
                    if payload is None or ended:
                        continue
                    if apply_event(record, payload, now):
                        ended = True
                        record.e2e = now
        if record.e2e is None:
            record.e2e = time.perf_counter() - record.start
        if record.status == "error":
            return record
        if not ended:
            record.status, record.error = "error", "stream closed without [DONE]"
        elif audio_expected and record.audio_samples == 0:
            record.status, record.error = "error", "no audio in the response"
        else:
            record.status = "ok"
    except asyncio.CancelledError:
        record.status = "cut"
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a measurement, not a crash
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"[:300]
        record.e2e = time.perf_counter() - record.start
    return record
