# One backend stream turned into reply pieces, whatever the response style: text after stop-string
# matching, tool calls split off the text, audio as pcm16, the final piece with finish_reason and usage;
# metrics observed on the way.
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.audio_encoding import to_pcm16
from openai_frontend.chat_params import ChatPlan
from openai_frontend.metrics import RequestMeter
from openai_frontend.omni_client import OmniChunk, OmniClient
from openai_frontend.stop_strings import StopMatcher
from openai_frontend.tool_calls import ToolCallSplitter


@dataclass
class Piece:
    text: str = ""
    pcm16: bytes = b""
    finish_reason: str | None = None  # set on the last piece only
    usage: dict[str, Any] | None = None  # last piece: the backend's report (openai_frontend/usage.py)
    tokens: int = 0  # text tokens in this piece's backend response
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # complete calls (tool_calls.tool_call)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


async def reply_pieces(client: OmniClient, plan: ChatPlan, request_id: str, meter: RequestMeter) -> AsyncIterator[Piece]:
    """Pieces of one reply; the last has finish_reason set. Leaving early cancels the backend request.

    A stop string ends the reply with finish_reason "stop": the backend request is cancelled, so the audio
    ends where it had got to (speech lags the text, so it may stop short of the stop string).
    With tools, the <tool_call> blocks are split off the text. A call is never spoken: omni_ensemble ends the
    talker's utterance where the thinker opens one (tests/unit/test_tool_call_unspoken.py), so every audio chunk,
    also one that comes after the call began (speech lags the text), is speech of the text before it.
    """
    stops = StopMatcher(list(plan.stop))
    calls = ToolCallSplitter() if plan.tools else None
    meter.start()
    try:
        async with aclosing(client.stream(plan.messages, plan.parameters, request_id=request_id)) as chunks:
            meter.submitted()
            tokens = 0
            async for chunk in chunks:
                tokens += len(chunk.token_ids)
                meter.tokens(len(chunk.token_ids))
                piece = _piece(chunk, plan, stops)
                if stops.stopped:
                    piece.finish_reason, piece.usage = "stop", _usage(chunk.usage, tokens)
                elif chunk.is_final:
                    piece.text += stops.flush()
                    piece.usage = _usage(chunk.usage, tokens)
                if calls is not None:
                    piece.text, piece.tool_calls = calls.feed(piece.text)
                    if piece.is_final:
                        piece.text += calls.flush()
                        piece.finish_reason = "tool_calls" if calls.calls else piece.finish_reason
                meter.audio(len(piece.pcm16) // 2)
                if piece.is_final:
                    meter.finish(piece.usage)
                    yield piece
                    return
                yield piece
        # a backend stream that ended without a final chunk (fakes may): the reply ends there
        final = Piece(text=stops.flush() + (calls.flush() if calls is not None else ""), finish_reason="stop",
                      usage=_usage(None, tokens))
        meter.finish(final.usage)
        yield final
    finally:
        meter.close()


def _piece(chunk: OmniChunk, plan: ChatPlan, stops: StopMatcher) -> Piece:
    return Piece(
        text=stops.feed(chunk.text),
        pcm16=to_pcm16(chunk.audio) if plan.audio_out else b"",
        finish_reason=chunk.finish_reason,
        tokens=len(chunk.token_ids),
    )


def _usage(reported: dict[str, Any] | None, tokens_seen: int) -> dict[str, Any]:
    usage = dict(reported or {})
    usage.setdefault("completion_tokens", tokens_seen)  # the backend's count wins: it knows about EOS
    return usage
