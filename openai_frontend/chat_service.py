# One chat completion against the OmniClient: collected into a chat.completion, or streamed as SSE
# chat.completion.chunk events. FastAPI-free; the router only wires HTTP to these two functions.
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from openai_frontend import chat_render as render
from openai_frontend.audio_encoding import encode_audio, to_pcm16
from openai_frontend.chat_params import ChatPlan
from openai_frontend.errors import describe
from openai_frontend.omni_client import OmniChunk, OmniClient
from openai_frontend.sse import DONE, sse_event

log = logging.getLogger("openai_frontend")


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def complete(client: OmniClient, plan: ChatPlan, ids: render.ResponseIds) -> dict[str, Any]:
    text: list[str] = []
    pcm: list[bytes] = []
    tokens = 0
    last = OmniChunk(finish_reason="stop")
    async with aclosing(client.stream(plan.messages, plan.parameters, request_id=ids.id)) as chunks:
        async for chunk in chunks:
            text.append(chunk.text)
            tokens += len(chunk.token_ids)
            if plan.audio_out:
                pcm.append(to_pcm16(chunk.audio))
            if chunk.is_final:
                last = chunk
                break
    reply = "".join(text)
    return render.completion(
        ids,
        text=reply,
        audio=encode_audio(b"".join(pcm), plan.audio_format) if plan.audio_out else None,
        text_out=plan.text_out,
        finish_reason=last.finish_reason or "stop",
        usage=render.usage(last.usage, tokens_seen=tokens, audio_out=plan.audio_out),
    )


async def stream_events(client: OmniClient, plan: ChatPlan, ids: render.ResponseIds) -> AsyncIterator[str]:
    """SSE events of one streamed completion, ending with `data: [DONE]`.

    An error before the first backend response is raised (the response is then an HTTP error);
    after it, an error becomes a `data: {"error": ...}` event followed by [DONE].
    """
    async with aclosing(client.stream(plan.messages, plan.parameters, request_id=ids.id)) as chunks:
        chunk = await anext(chunks, OmniChunk(finish_reason="stop"))
        yield sse_event(_json(render.chunk(ids, {"role": "assistant", "content": ""})))
        tokens = 0
        try:
            while True:
                tokens += len(chunk.token_ids)
                pcm = to_pcm16(chunk.audio) if plan.audio_out else b""
                delta = render.delta(ids, text=chunk.text, pcm16=pcm, text_out=plan.text_out)
                if delta is not None:
                    yield sse_event(_json(render.chunk(ids, delta)))
                if chunk.is_final:
                    break
                chunk = await anext(chunks, OmniChunk(finish_reason="stop"))
        except Exception as exc:  # noqa: BLE001 - reported to the client in-stream
            status, body = describe(exc)
            log.info("[%s] stream ended by an error event (%d): %s", ids.id, status, body["error"]["message"])
            yield sse_event(_json(body))
            yield DONE
            return
    if plan.audio_out:  # OpenAI ends streamed audio with an update holding only its expiry
        yield sse_event(_json(render.chunk(ids, {"audio": {"id": ids.audio_id, "expires_at": ids.created}})))
    yield sse_event(_json(render.chunk(ids, {}, finish_reason=chunk.finish_reason)))
    if plan.include_usage:
        usage = render.usage(chunk.usage, tokens_seen=tokens, audio_out=plan.audio_out)
        yield sse_event(_json(render.usage_chunk(ids, usage)))
    yield DONE
