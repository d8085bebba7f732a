# Chat-completion objects as plain dicts (chat.completion, chat.completion.chunk) and the OpenAI
# response style; chat_render_vllm.py has the vLLM-Omni one. Pure functions of what the stream produced;
# chat_service.py decides when each is sent.
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


def chunk(ids: ResponseIds, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        **extra,
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


def completion(ids: ResponseIds, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "choices": choices,
        "usage": usage,
    }


def choice(index: int, message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}


def audio_object(ids: ResponseIds, data: bytes, transcript: str, expires_at: int) -> dict[str, Any]:
    return {"id": ids.audio_id, "data": b64(data), "expires_at": expires_at, "transcript": transcript}


def message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
    return out


class OpenAIStyle:
    """OpenAI's shape. With audio, the reply text is the audio's transcript and `content` stays null:
    choices[0].message.audio {id, data (a whole file), expires_at, transcript}; streamed, delta.audio
    carries `transcript` pieces and `data` (raw pcm16 chunks), and a last update holds `expires_at`.
    Without audio, the text is `content`. Tool calls are `tool_calls`, whatever the modalities."""

    def __init__(self, ids: ResponseIds, *, text_out: bool, audio_out: bool, audio_format: str):
        self.ids, self.text_out, self.audio_out, self.audio_format = ids, text_out, audio_out, audio_format

    def completion(self, text: str, audio: bytes | None, finish_reason: str, usage: dict[str, Any],
                   tool_calls: list[dict[str, Any]], expires_at: int) -> dict[str, Any]:
        """`audio`: the encoded file when audio was requested, else None."""
        msg = message(None if audio is not None else text, tool_calls)
        if audio is not None:
            msg["audio"] = audio_object(self.ids, audio, text, expires_at)
        return completion(self.ids, [choice(0, msg, finish_reason)], usage)

    def opening(self) -> list[dict[str, Any]]:
        return [chunk(self.ids, {"role": "assistant", "content": None if self.audio_out else ""})]

    def piece(self, text: str, pcm16: bytes, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Streamed audio is raw s16le 24 kHz mono, base64, whatever the requested file format (as OpenAI
        streams): WAV headers per chunk would make the concatenation of chunks not a valid file."""
        out: dict[str, Any] = {}
        if text and not self.audio_out:
            out["content"] = text
        if self.audio_out and (text or pcm16):
            audio: dict[str, Any] = {"id": self.ids.audio_id}
            if text:
                audio["transcript"] = text
            if pcm16:
                audio["data"] = b64(pcm16)
            out["audio"] = audio
        if tool_calls:
            out["tool_calls"] = tool_calls
        return [chunk(self.ids, out)] if out else []

    def closing(self, finish_reason: str, expires_at: int) -> list[dict[str, Any]]:
        out = []
        if self.audio_out:  # OpenAI ends streamed audio with an update holding only its expiry
            out.append(chunk(self.ids, {"audio": {"id": self.ids.audio_id, "expires_at": expires_at}}))
        out.append(chunk(self.ids, {}, finish_reason=finish_reason))
        return out
