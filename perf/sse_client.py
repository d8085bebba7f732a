# One streamed chat completion against the OpenAI frontend, timed the way vLLM-Omni's benchmark client
# times it: the clock starts just before the POST; every SSE event is stamped on arrival.
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
    if event.get("usage"):
        usage = event["usage"]
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        record.audio_frames = (usage.get("completion_tokens_details") or {}).get("audio_tokens")
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            record.text_chunks += 1
            if record.ttft is None:
                record.ttft = t
        audio = delta.get("audio") or {}
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


async def stream_chat(
    client, url: str, body: dict, record: RequestRecord, audio_expected: bool = True
) -> RequestRecord:
    """POSTs body (stream: true) and fills record; never raises except CancelledError (marked `cut`)."""
    record.start = time.perf_counter()
    ended = False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.status, record.error = "error", f"HTTP {response.status_code}: {text[:300]}"
                record.e2e = time.perf_counter() - record.start
                return record
            async for line in response.aiter_lines():
                data = _data(line)
                if data is None:
                    continue
                if apply_event(record, data, time.perf_counter() - record.start):
                    ended = True
                    break
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
