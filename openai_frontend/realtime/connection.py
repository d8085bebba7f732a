# One realtime session over one WebSocket: client events in, server events out. Transport-free: the router
# hands it `receive` (the next text frame, None once the client left), `send_text` and `close`.
#
# The receive loop handles every client event in order; a response runs in a task of its own, so audio
# keeps arriving (and barge-in is heard) while it speaks. Sends from both go through one lock, so events
# never interleave mid-frame. When the client leaves, the running response is cancelled, which frees
# every stage of its backend request.
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from openai_frontend.metrics import FrontendMetrics, RequestMeter
from openai_frontend.omni_client import OmniClient
from openai_frontend.realtime import events as ev
from openai_frontend.realtime.conversation import Conversation, Item, audio_item, item_from_client
from openai_frontend.realtime.events import EventError, error_event, field as get, new_id
from openai_frontend.realtime.input_buffer import SAMPLES_PER_MS, InputBuffer
from openai_frontend.realtime.response import Response, ResponsePlan
from openai_frontend.realtime.session import SessionConfig, format_from_client, max_output_tokens, voice, _modalities
from openai_frontend.settings import FrontendSettings

log = logging.getLogger("openai_frontend.realtime")

# response.create's `response` fields; tool_choice, prompt, parallel_tool_calls and reasoning have no effect here
RESPONSE_KEYS = {"audio", "conversation", "input", "instructions", "max_output_tokens", "metadata", "output_modalities",
                 "tools", "tool_choice", "prompt", "parallel_tool_calls", "reasoning"}  # fmt: skip
MIN_COMMIT_MS = 100  # OpenAI's floor for a committed buffer; shorter audio gives the encoder nothing to read


@dataclass(frozen=True)
class RealtimeLimits:
    """What a deployer bounds per server and per session; each breach is an `error` event and a close."""

    max_sessions: int = 256  # open sessions per frontend process
    idle_timeout_s: float = 600.0  # no client event and no response running for this long
    max_buffered_audio_s: float = 120.0  # input audio not yet committed
    max_conversation_tokens: int = 16384  # prompt + reply tokens of the last response

    def __post_init__(self) -> None:
        if min(self.max_sessions, self.idle_timeout_s, self.max_buffered_audio_s, self.max_conversation_tokens) <= 0:
            raise ValueError("realtime limits must be positive")


class RealtimeConnection:
    def __init__(self, client: OmniClient, settings: FrontendSettings, limits: RealtimeLimits,
                 metrics: FrontendMetrics | None, send_text: Callable[[str], Awaitable[None]],
                 close: Callable[[int, str], Awaitable[None]]):  # fmt: skip
        self.client, self.settings, self.limits, self.metrics = client, settings, limits, metrics
        self._send_text, self._close = send_text, close
        self._lock = asyncio.Lock()
        self.id = new_id("sess")
        self.config = SessionConfig.default(settings)
        self.conversation = Conversation()
        self.input = InputBuffer(self.config.input_format, self.config.turn_detection, limits.max_buffered_audio_s)
        self.speech_item_id: str | None = None  # the user item a detected turn will become
        self.response: Response | None = None
        self.response_task: asyncio.Task | None = None
        self.closed = False

    # ---- transport -------------------------------------------------------------------------------------
    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        event.setdefault("event_id", new_id("event"))
        async with self._lock:
            try:
                await self._send_text(ev.dumps(event))
            except Exception:  # noqa: BLE001 - the client is gone; the receive loop ends the session
                self.closed = True

    async def fail(self, err: EventError, client_event_id: str | None = None) -> None:
        await self.send(error_event(err, client_event_id))
        if err.close:
            await self.shutdown(1008 if err.code != "server_overloaded" else 1013, err.code)

    async def shutdown(self, code: int, reason: str) -> None:
        if not self.closed:
            async with self._lock:
                self.closed = True
                try:
                    await self._close(code, reason)
                except Exception:  # noqa: BLE001 - already closed by the client
                    pass
        await self.cancel_response("client_cancelled")

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> None:
        await self.send({"type": "session.created", "session": self.config.public(self.id)})
        try:
            while not self.closed:
                try:
                    raw = await asyncio.wait_for(receive(), self.limits.idle_timeout_s)
                except asyncio.TimeoutError:  # the builtin only from Python 3.11 on
                    if self.response_task is not None:
                        continue
                    await self.fail(EventError(f"session idle for {self.limits.idle_timeout_s:g} s; closing",
                                               code="idle_timeout", close=True))  # fmt: skip
                    return
                if raw is None:
                    return
                await self.handle(raw)
        finally:
            self.closed = True
            await self.cancel_response("client_cancelled")

    async def handle(self, raw: str | bytes) -> None:
        event_id = None
        try:
            event = ev.parse(raw)
            event_id = event.get("event_id")
            await getattr(self, "on_" + event["type"].replace(".", "_"))(event)
        except EventError as err:
            await self.fail(err, event_id or err.client_event_id)

    # ---- session and input audio -----------------------------------------------------------------------
    async def on_session_update(self, event: dict[str, Any]) -> None:
        self.config = self.config.updated(get(event, "session", dict), self.settings)
        self.input.reconfigure(self.config.input_format, self.config.turn_detection)
        await self.send({"type": "session.updated", "session": self.config.public(self.id)})

    async def on_input_audio_buffer_append(self, event: dict[str, Any]) -> None:
        try:
            raw = base64.b64decode(get(event, "audio", str), validate=True)
        except (binascii.Error, ValueError):
            raise EventError("audio is not valid base64", code="invalid_base64", param="audio") from None
        for turn in self.input.append(raw):
            if turn.kind == "speech_started":
                await self._speech_started(turn.audio_ms)
            else:
                await self._speech_stopped(turn.audio_ms)
        self.input.trim_idle()

    async def _speech_started(self, audio_start_ms: int) -> None:
        self.input.drop_before(audio_start_ms * SAMPLES_PER_MS)
        self.speech_item_id = new_id("item")
        await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": audio_start_ms,
                         "item_id": self.speech_item_id})  # fmt: skip
        if self.config.turn_detection["interrupt_response"]:
            await self.cancel_response("turn_detected")

    async def _speech_stopped(self, audio_end_ms: int) -> None:
        item_id, self.speech_item_id = self.speech_item_id or new_id("item"), None
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": audio_end_ms, "item_id": item_id})
        await self._commit(self.input.take_until(audio_end_ms), item_id)
        if self.config.turn_detection["create_response"] and self.response_task is None:
            await self.start_response(ResponsePlan(self._messages(), self.config, conversation_id=self.conversation.id))

    async def _commit(self, pcm: bytes, item_id: str) -> None:
        item = audio_item(pcm)
        item.id = item_id
        previous = self.conversation.add(item)
        await self.send({"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous})
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.public()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.public()})

    async def on_input_audio_buffer_commit(self, event: dict[str, Any]) -> None:
        pcm = self.input.take_all()  # a client commit ends the utterance: the resampler's delay belongs to it
        if len(pcm) // 2 < MIN_COMMIT_MS * SAMPLES_PER_MS:
            raise EventError(f"buffer too small: {len(pcm) // 2 // SAMPLES_PER_MS} ms of audio, at least "
                             f"{MIN_COMMIT_MS} ms are needed", code="input_audio_buffer_commit_empty")  # fmt: skip
        item_id, self.speech_item_id = self.speech_item_id or new_id("item"), None
        await self._commit(pcm, item_id)

    async def on_input_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        self.input.clear()
        await self.send({"type": "input_audio_buffer.cleared"})

    # ---- conversation items ----------------------------------------------------------------------------
    async def on_conversation_item_create(self, event: dict[str, Any]) -> None:
        item = item_from_client(event.get("item"), self.config.input_format)
        previous = get(event, "previous_item_id", str, required=False)
        previous = self.conversation.add(item, previous)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.public()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.public()})

    async def on_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        item = self.conversation.get(get(event, "item_id", str))
        await self.send({"type": "conversation.item.retrieved", "item": item.public(self.config.input_format)})

    async def on_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item_id = get(event, "item_id", str)
        self.conversation.index(item_id)
        if self.response is not None and self.response.item.id == item_id:
            await self.cancel_response("client_cancelled")
        self.conversation.delete(item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def on_conversation_item_truncate(self, event: dict[str, Any]) -> None:
        item_id, end_ms = get(event, "item_id", str), get(event, "audio_end_ms", int)
        if get(event, "content_index", int, required=False) not in (None, 0):
            raise EventError("an assistant item has one content part: content_index must be 0", param="content_index")
        item = self.conversation.get(item_id)
        if item.role != "assistant" or not item.audio_out:
            raise EventError("only assistant audio items can be truncated", param="item_id")
        if self.response is not None and self.response.item is item:
            await self.cancel_response("client_cancelled")  # the listener stopped: generating more is waste
        if not 0 <= end_ms <= item.audio_ms + 1:
            raise EventError(f"audio_end_ms {end_ms} is outside the item's {item.audio_ms:.0f} ms of audio",
                             param="audio_end_ms")  # fmt: skip
        item.truncate(end_ms)
        await self.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                         "audio_end_ms": end_ms})  # fmt: skip

    def _messages(self, config: SessionConfig | None = None) -> list[dict[str, Any]]:
        return self.conversation.messages((config or self.config).instructions)

    # ---- responses -------------------------------------------------------------------------------------
    async def on_response_create(self, event: dict[str, Any]) -> None:
        if self.response_task is not None:
            raise EventError(f"response {self.response.plan.id} is in progress; cancel it or wait for response.done",
                             code="conversation_already_has_active_response")  # fmt: skip
        options = get(event, "response", dict, required=False) or {}
        config, into, items = self._response_config(options)
        messages = Conversation() if items is not None else self.conversation
        if items is not None:
            for item in items:
                messages.add(item)
        plan = ResponsePlan(messages.messages(config.instructions), config,
                            metadata=get(options, "metadata", dict, required=False, where="response."),
                            conversation_id=self.conversation.id if into else None)  # fmt: skip
        if not any(m["role"] in ("user", "assistant") for m in plan.messages):
            raise EventError("nothing to respond to: the conversation has no user item", code="empty_conversation")
        await self.start_response(plan)

    def _response_config(self, options: dict[str, Any]) -> tuple[SessionConfig, bool, list[Item] | None]:
        config = replace(self.config)
        where = "response."
        for key in options:
            if key not in RESPONSE_KEYS:
                raise EventError(f"unknown parameter 'response.{key}'", code="unknown_parameter",
                                 param=f"response.{key}")  # fmt: skip
        if options.get("tools"):
            raise EventError("tools are not supported", code="unsupported", param="response.tools")
        if "instructions" in options:
            config.instructions = get(options, "instructions", str, where=where)
        if "output_modalities" in options:
            config.output_modalities = _modalities(options["output_modalities"], "response.output_modalities")
        if "max_output_tokens" in options:
            config.max_output_tokens = max_output_tokens(options["max_output_tokens"], "response.max_output_tokens")
        out = (get(options, "audio", dict, required=False, where=where) or {}).get("output") or {}
        if "voice" in out:
            config.voice = voice(out["voice"], self.settings, "response.audio.output.voice")
        if "format" in out:
            config.output_format = format_from_client(out["format"], "response.audio.output.format")
        conversation = options.get("conversation", "auto")
        if conversation not in ("auto", "none"):
            raise EventError("response.conversation must be 'auto' or 'none'", param="response.conversation")
        items = None
        if "input" in options:
            items = [self._input_item(i, item) for i, item in enumerate(get(options, "input", list, where=where))]
        return config, conversation == "auto", items

    def _input_item(self, i: int, item: Any) -> Item:
        """One item of response.input: a new message, or a reference to an item of the conversation."""
        if isinstance(item, dict) and item.get("type") == "item_reference":
            where = f"response.input[{i}]."
            return self.conversation.get(get(item, "id", str, where=where), f"{where}id")
        return item_from_client(item, self.config.input_format)

    async def start_response(self, plan: ResponsePlan) -> None:
        meter = RequestMeter(self.metrics, time.perf_counter(), request_id=plan.id) if self.metrics else None
        self.response = Response(plan, self.send, meter)
        self.response_task = asyncio.create_task(self._respond(self.response))

    async def _respond(self, response: Response) -> None:
        async def add_item(item: Item) -> None:
            if response.plan.into_conversation:
                previous = self.conversation.add(item)
                await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.public()})

        try:
            outcome = await response.run(self.client, add_item)
        finally:
            if self.response is response:
                self.response, self.response_task = None, None
        usage = outcome.usage or {}
        used = int(usage.get("input_tokens", 0)) + int(usage.get("output_token_details", {}).get("text_tokens", 0))
        if used >= self.limits.max_conversation_tokens:
            await self.fail(EventError(f"the conversation holds {used} tokens, the limit is "
                                       f"{self.limits.max_conversation_tokens}; start a new session",
                                       code="conversation_too_long", close=True))  # fmt: skip

    async def on_response_cancel(self, event: dict[str, Any]) -> None:
        wanted = get(event, "response_id", str, required=False)
        if self.response is None or wanted not in (None, self.response.plan.id):
            raise EventError("no response in progress" if self.response is None else
                             f"response {wanted!r} is not in progress", code="response_cancel_not_active")  # fmt: skip
        await self.cancel_response("client_cancelled")

    async def cancel_response(self, reason: str) -> None:
        """Cancel the running response (if any) and wait until its events have ended."""
        task, response = self.response_task, self.response
        if task is None or task.done() or task is asyncio.current_task():
            return
        if response.outcome.status == "in_progress":  # else it is only sending its closing events
            response.cancel_reason = reason
            task.cancel()
        await asyncio.wait({task})

