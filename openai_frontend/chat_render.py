# OpenAI chat-completion objects as plain dicts (chat.completion, chat.completion.chunk, usage).
# Pure functions of what the stream produced; chat_service.py decides when each is sent.
from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ResponseIds:
    """Identifiers shared by every object of one response."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def usage(reported: dict[str, Any] | None, *, tokens_seen: int, audio_out: bool) -> dict[str, Any]:
    # completion_tokens counts text tokens (what the thinker generated); codec frames are reported
    # separately as completion_tokens_details.audio_tokens.
    reported = reported or {}
    prompt = int(reported.get("prompt_tokens", 0))
    completion = int(reported.get("completion_tokens", tokens_seen))
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if audio_out:
        out["completion_tokens_details"] = {"audio_tokens": int(reported.get("audio_frames", 0))}
    return out


def completion(
    ids: ResponseIds,
    *,
    text: str,
    audio: bytes | None,
    text_out: bool,
    finish_reason: str,
    usage: dict[str, Any],
) -> dict[str, Any]:
    """`audio`: the encoded file (wav or pcm) when audio was requested, else None."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text_out else None}
    if audio is not None:
        # Nothing is stored server-side, so the id cannot be referenced later: expires at once.
        message["audio"] = {"id": ids.audio_id, "data": b64(audio), "expires_at": ids.created, "transcript": text}
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage,
    }


def chunk(ids: ResponseIds, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def usage_chunk(ids: ResponseIds, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "choices": [],
        "usage": usage,
    }


def delta(ids: ResponseIds, *, text: str, pcm16: bytes, text_out: bool) -> dict[str, Any] | None:
    """The delta for one backend response, or None when it carries nothing to send.

    Streamed audio is raw s16le 24 kHz mono, base64, whatever the requested file format (as OpenAI
    streams): WAV headers per chunk would make the concatenation of chunks not a valid file.
    Text goes to `content` when text was requested, else to the audio transcript.
    """
    out: dict[str, Any] = {}
    if text and text_out:
        out["content"] = text
    transcript = "" if text_out else text
    if pcm16 or transcript:
        audio: dict[str, Any] = {"id": ids.audio_id, "transcript": transcript}
        if pcm16:
            audio["data"] = b64(pcm16)
        out["audio"] = audio
    return out or None
