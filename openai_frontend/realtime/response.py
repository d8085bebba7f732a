# One realtime response: one `omni_ensemble` request whose prompt is the conversation so far, streamed as
# the GA response events (created, output item, content part, audio / transcript or text deltas, done).
# With tools offered, the reply's <tool_call> blocks (tool_calls.py) become function_call output items after
# the message item, once the reply has ended: omni_ensemble ends the talker's utterance where the first call
# begins, so all the audio of the stream is the message's, and the message item is done before the calls.
# Cancelling the task that runs it (response.cancel, barge-in, the client leaving) closes the backend
# stream, which cancels the Triton request and frees every stage; the events then end with status
# "cancelled", the item keeps what was produced, and usage counts it (the prompt as the backend reported it
# when the thinker started, the text and audio that reached the client).
from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.errors import describe
from openai_frontend.metrics import RequestMeter
from openai_frontend.omni_client import OmniClient
from openai_frontend.realtime.audio import OutputAudio
from openai_frontend.realtime.conversation import FRAME_MS, AnyItem, FunctionCall, Item
from openai_frontend.realtime.events import new_id
from openai_frontend.realtime.session import SessionConfig, audio_format
from openai_frontend.tool_calls import ToolCallSplitter
from openai_frontend.usage import realtime_usage

Send = Callable[[dict[str, Any]], Awaitable[None]]
OnItem = Callable[[AnyItem], Awaitable[None]]
_STAGE_PREFIX = ("", "talker_")  # sampling_params_list index -> omni_ensemble parameter prefix


@dataclass
class ResponsePlan:
    messages: list[dict[str, Any]]
    config: SessionConfig  # the session's, with this response's overrides applied
    id: str = field(default_factory=lambda: new_id("resp"))
    metadata: dict[str, str] | None = None
    conversation_id: str | None = None  # None: conversation "none", an out-of-band response

    @property
    def into_conversation(self) -> bool:
        return self.conversation_id is not None

    def parameters(self) -> dict[str, Any]:
        c = self.config
        params: dict[str, Any] = {"modalities": "text,audio" if c.audio_out else "text"}
        if c.audio_out:
            # the client plays the audio as it arrives: chunks sized to keep it ahead of playback
            params["speaker"], params["chunk_schedule"] = c.speaker, "playback"
        for prefix, stage in zip(_STAGE_PREFIX, c.sampling_params_list or ()):
            params.update({prefix + k: v for k, v in (stage or {}).items()})
        if c.max_output_tokens != "inf":
            params["max_tokens"] = c.max_output_tokens
        return params


@dataclass
class Outcome:
    status: str = "in_progress"  # completed | cancelled | incomplete | failed
    reason: str | None = None  # turn_detected | client_cancelled | max_output_tokens
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


class Response:
    def __init__(self, plan: ResponsePlan, send: Send, meter: RequestMeter | None = None):
        self.plan, self.send, self.meter = plan, send, meter
        # the message item: announced with the reply's first text or audio (a reply that is only function calls
        # has none), or at the end when the reply brought nothing at all
        self.item = Item(role="assistant", status="in_progress", audio_out=plan.config.audio_out)
        self.opened = False
        self.calls: list[FunctionCall] = []  # the reply's function calls, announced after the message item
        self.on_item: OnItem | None = None  # adds an output item to the conversation (and says so); set by run
        self.outcome = Outcome()
        self.cancel_reason = "client_cancelled"  # what a cancellation of the task means; set by who cancels
        self.first_audio_at: float | None = None  # perf_counter of the first audio delta sent
        self.task: asyncio.Task | None = None  # the task that runs it, set by whoever starts it
        self.reported: dict[str, Any] | None = None  # the backend's latest usage report
        self.tokens = 0  # text tokens received
        self.audio_ms = 0.0  # audio sent

    async def cancel(self, reason: str) -> None:
        """Cancel it (if it still runs) and wait until its events have ended."""
        task = self.task
        if task is None or task.done() or task is asyncio.current_task():
            return
        if self.outcome.status == "in_progress":  # else it is only sending its closing events
            self.cancel_reason = reason
            task.cancel()
        await asyncio.wait({task})

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.plan.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    @property
    def output(self) -> list[AnyItem]:
        return [self.item, *self.calls] if self.opened else list(self.calls)

    def public(self) -> dict[str, Any]:
        c, o = self.plan.config, self.outcome
        details = None if o.status in ("in_progress", "completed") else \
            {"type": o.status, "reason": o.reason, "error": o.error}  # fmt: skip
        return {
            "object": "realtime.response", "id": self.plan.id, "status": o.status, "status_details": details,
            "output": [item.public() for item in self.output] if o.status != "in_progress" else [],
            "conversation_id": self.plan.conversation_id,
            "output_modalities": list(c.output_modalities), "max_output_tokens": c.max_output_tokens,
            "audio": {"output": {"format": audio_format(c.output_format), "voice": c.voice}},
            "usage": o.usage, "metadata": self.plan.metadata,
        }  # fmt: skip

    async def run(self, client: OmniClient, on_item: OnItem) -> Outcome:
        """Stream the response; `on_item` adds each output item to the conversation (and says so)."""
        self.on_item = on_item
        await self.send({"type": "response.created", "response": self.public()})
        try:
            await self._stream(client)
        except asyncio.CancelledError:  # the task was cancelled on purpose: it ends here, with its events
            self.outcome.status, self.outcome.reason = "cancelled", self.cancel_reason
            self.outcome.usage = self._usage_so_far()
        except Exception as exc:  # noqa: BLE001 - the backend's error goes to the client in response.done
            status, body = describe(exc)
            self.outcome.status = "failed"
            self.outcome.error = {"type": body["error"]["type"], "code": str(body["error"]["code"] or status),
                                  "message": body["error"]["message"]}  # fmt: skip
            # a usage object in every response.done: clients read it before the status (Pipecat does)
            self.outcome.usage = self._usage_so_far()
        await self._finish()
        return self.outcome

    def _usage_so_far(self) -> dict[str, Any]:
        """A response that did not finish: its prompt as reported, the text and audio that reached the client."""
        frames = math.ceil(round(self.audio_ms, 3) / FRAME_MS)  # a frame's audio reached the client, or its part
        return realtime_usage(self.reported, self.tokens, frames)

    async def _stream(self, client: OmniClient) -> None:
        out = OutputAudio(self.plan.config.output_format) if self.item.audio_out else None
        kind = "response.output_audio_transcript.delta" if out else "response.output_text.delta"
        splitter = ToolCallSplitter() if self.plan.config.prompt_tools else None
        if self.meter is not None:
            self.meter.start()
        chunks = client.stream(self.plan.messages, self.plan.parameters(), request_id=self.plan.id)
        async with aclosing(chunks):
            if self.meter is not None:
                self.meter.submitted()
            async for chunk in chunks:
                self.tokens += len(chunk.token_ids)
                self.reported = chunk.usage or self.reported
                if self.meter is not None:
                    self.meter.tokens(len(chunk.token_ids))
                text = chunk.text
                if splitter is not None:
                    text, calls = splitter.feed(text)
                    text += splitter.flush() if chunk.is_final else ""
                    self.calls += [FunctionCall(c["function"]["name"], c["function"]["arguments"], c["id"],
                                                status="in_progress") for c in calls]  # fmt: skip
                if text:
                    await self._open()
                    self.item.pieces.append((self.tokens, text))
                    await self.send({"type": kind, **self._ids(), "delta": text})
                if out is not None and (chunk.audio is not None or chunk.is_final):
                    data = out.encode(chunk.audio if chunk.audio is not None else [], last=chunk.is_final)
                    if data:
                        await self._open()
                        await self._audio(data, out)
                if chunk.is_final:
                    self.outcome.usage = realtime_usage(chunk.usage, self.tokens)
                    if self.meter is not None:
                        self.meter.finish(chunk.usage)
                    length = chunk.finish_reason == "length" and self.plan.config.max_output_tokens != "inf"
                    self.outcome.status = "incomplete" if length else "completed"
                    self.outcome.reason = "max_output_tokens" if length else None
                    return

    async def _audio(self, data: bytes, out: OutputAudio) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.perf_counter()
        if self.meter is not None:
            self.meter.audio(int(out.bytes_to_ms(len(data)) * 24))
        self.item.audio_ms += out.bytes_to_ms(len(data))
        self.audio_ms += out.bytes_to_ms(len(data))
        await self.send({"type": "response.output_audio.delta", **self._ids(), "delta": base64.b64encode(data).decode()})

    async def _added(self, item: AnyItem, output_index: int) -> None:
        await self.send({"type": "response.output_item.added", "response_id": self.plan.id,
                         "output_index": output_index, "item": item.public()})  # fmt: skip
        await self.on_item(item)

    async def _done(self, item: AnyItem, output_index: int) -> None:
        await self.send({"type": "response.output_item.done", "response_id": self.plan.id,
                         "output_index": output_index, "item": item.public()})  # fmt: skip
        if self.plan.into_conversation:
            await self.send({"type": "conversation.item.done", "item": item.public()})

    async def _open(self) -> None:
        """Announce the message item, once: output item, conversation item, content part."""
        if self.opened:
            return
        self.opened = True
        await self._added(self.item, 0)
        part = {"type": "audio", "transcript": ""} if self.item.audio_out else {"type": "text", "text": ""}
        await self.send({"type": "response.content_part.added", **self._ids(), "part": part})

    async def _finish(self) -> None:
        if self.meter is not None:
            self.meter.close()
        if not self.calls:
            await self._open()
        if self.opened:
            await self._close_message()
        for index, call in enumerate(self.calls, start=int(self.opened)):
            await self._call(call, index)
        await self.send({"type": "response.done", "response": self.public()})

    async def _close_message(self) -> None:
        ids, text = self._ids(), self.item.text
        if self.item.audio_out:
            await self.send({"type": "response.output_audio.done", **ids})
            await self.send({"type": "response.output_audio_transcript.done", **ids, "transcript": text})
            part = {"type": "audio", "transcript": text}
        else:
            await self.send({"type": "response.output_text.done", **ids, "text": text})
            part = {"type": "text", "text": text}
        await self.send({"type": "response.content_part.done", **ids, "part": part})
        self.item.status = "completed" if self.outcome.status == "completed" else "incomplete"
        await self._done(self.item, 0)

    async def _call(self, call: FunctionCall, output_index: int) -> None:
        """One function call as an output item: complete when the reply ends, so its arguments come in one delta."""
        await self._added(call, output_index)
        ids = {"response_id": self.plan.id, "item_id": call.id, "output_index": output_index, "call_id": call.call_id}
        await self.send({"type": "response.function_call_arguments.delta", **ids, "delta": call.arguments})
        await self.send({"type": "response.function_call_arguments.done", **ids, "name": call.name,
                         "arguments": call.arguments})  # fmt: skip
        call.status = "completed"
        await self._done(call, output_index)
