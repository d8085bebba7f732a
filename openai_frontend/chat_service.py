# One chat completion against the OmniClient: collected into a chat.completion, or streamed as SSE
# chat.completion.chunk events, in the plan's response style. FastAPI-free; the router only wires HTTP
# to these two functions.
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from openai_frontend import chat_render as render
from openai_frontend.audio_encoding import encode_audio
from openai_frontend.audio_store import AudioStore
from openai_frontend.chat_params import ChatPlan
from openai_frontend.chat_render_vllm import VllmOmniStyle
from openai_frontend.chat_reply import reply_pieces
from openai_frontend.errors import describe
from openai_frontend.metrics import RequestMeter
from openai_frontend.omni_client import OmniClient
from openai_frontend.sse import DONE, sse_event
from openai_frontend.usage import chat_usage

log = logging.getLogger("openai_frontend")

STYLES = {"openai": render.OpenAIStyle, "vllm-omni": VllmOmniStyle}


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _style(plan: ChatPlan, ids: render.ResponseIds):
    return STYLES[plan.response_style](
        ids, text_out=plan.text_out, audio_out=plan.audio_out, audio_format=plan.audio_format
    )


def _usage(plan: ChatPlan, usage: dict[str, Any] | None) -> dict[str, Any]:
    return chat_usage(usage, tokens_seen=0, audio_out=plan.audio_out)


async def complete(client: OmniClient, plan: ChatPlan, ids: render.ResponseIds, meter: RequestMeter,
                   store: AudioStore) -> dict[str, Any]:
    text: list[str] = []
    pcm: list[bytes] = []
    calls: list[dict[str, Any]] = []
    async with aclosing(reply_pieces(client, plan, ids.id, meter)) as pieces:
        async for piece in pieces:
            text.append(piece.text)
            pcm.append(piece.pcm16)
            calls.extend(piece.tool_calls)
            if piece.is_final:
                break
    expires_at = _keep(store, plan, ids, "".join(text))
    audio = encode_audio(b"".join(pcm), plan.audio_format) if plan.audio_out else None
    return _style(plan, ids).completion("".join(text), audio, piece.finish_reason, _usage(plan, piece.usage),
                                        calls, expires_at)


def _keep(store: AudioStore, plan: ChatPlan, ids: render.ResponseIds, transcript: str) -> int:
    """Keeps a spoken reply for later turns to refer to; its expiry (what `audio.expires_at` says)."""
    expires_at = store.expires_at()
    if plan.audio_out:
        store.keep(ids.audio_id, transcript, expires_at)
    return expires_at


async def stream_events(
    client: OmniClient, plan: ChatPlan, ids: render.ResponseIds, meter: RequestMeter, store: AudioStore
) -> AsyncIterator[str]:
    """SSE events of one streamed completion, ending with `data: [DONE]`.

    An error before the first backend response is raised (the response is then an HTTP error);
    after it, an error becomes a `data: {"error": ...}` event followed by [DONE].
    """
    style = _style(plan, ids)
    text: list[str] = []
    async with aclosing(reply_pieces(client, plan, ids.id, meter)) as pieces:
        piece = await anext(pieces)
        for event in style.opening():
            yield sse_event(_json(event))
        try:
            while True:
                text.append(piece.text)
                for event in style.piece(piece.text, piece.pcm16, piece.tool_calls):
                    yield sse_event(_json(event))
                if piece.is_final:
                    break
                piece = await anext(pieces)
        except Exception as exc:  # noqa: BLE001 - reported to the client in-stream
            status, body = describe(exc)
            log.info("[%s] stream ended by an error event (%d): %s", ids.id, status, body["error"]["message"])
            yield sse_event(_json(body))
            yield DONE
            return
    expires_at = _keep(store, plan, ids, "".join(text))
    for event in style.closing(piece.finish_reason, expires_at):
        yield sse_event(_json(event))
    if plan.include_usage:
        yield sse_event(_json(render.usage_chunk(ids, _usage(plan, piece.usage))))
    yield DONE
