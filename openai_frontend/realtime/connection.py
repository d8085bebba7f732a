# One realtime session over one WebSocket: client events in, server events out. Transport-free: the router
# hands it `receive` (the next text frame, None once the client left), `send_text` and `close`.
#
# The receive loop handles every client event in order; each response runs in a task of its own (one in
# the conversation, a few out of band beside it), so audio keeps arriving (and barge-in is heard) while it
# speaks. Sends from all of them go through one lock, so events never interleave mid-frame. When the
# client leaves, every running response is cancelled, which frees every stage of its backend request.
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from openai_frontend.metrics import FrontendMetrics, RequestMeter
from openai_frontend.omni_client import OmniClient
from openai_frontend.realtime import events as ev
from openai_frontend.realtime.conversation import AnyItem, Conversation, Item, audio_item, item_from_client
from openai_frontend.realtime.events import EventError, error_event, field as get, new_id
from openai_frontend.realtime.input_buffer import SAMPLES_PER_MS, InputBuffer
from openai_frontend.realtime.response import Response, ResponsePlan
from openai_frontend.realtime.response_options import plan_response
from openai_frontend.realtime.session import SessionConfig
from openai_frontend.settings import FrontendSettings

log = logging.getLogger("openai_frontend.realtime")

# out-of-band responses a session may run beside the conversation's: each is a backend request, and more
# would let one session crowd out the others
MAX_OUT_OF_BAND = 4
MIN_COMMIT_MS = 100  # OpenAI's floor for a committed buffer; shorter audio gives the encoder nothing to read


@dataclass(frozen=True)
class RealtimeLimits:
    """What a deployer bounds per server and per session; each breach is an `error` event and a close."""

    max_sessions: int = 256  # open sessions per frontend process
    idle_timeout_s: float = 600.0  # no client event and no response running for this long
    max_buffered_audio_s: float = 120.0  # input audio not yet committed
    max_conversation_tokens: int = 16384  # prompt + reply tokens of the last response
    # text, images and audio of the conversation's items (conversation.py's Item.nbytes). The token limit is
    # checked only once a response has run, so a client that adds items and never asks for one is bounded by
    # this. 16384 tokens of audio are ~1300 s (12.5 tokens/s), 42 MB as the model hears it (16 kHz pcm16).
    max_conversation_mb: float = 64.0

    def __post_init__(self) -> None:
        if min(self.max_sessions, self.idle_timeout_s, self.max_buffered_audio_s, self.max_conversation_tokens,
               self.max_conversation_mb) <= 0:  # fmt: skip
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
        self.response: Response | None = None  # the one running in the conversation
        self.out_of_band: dict[str, Response] = {}  # conversation "none" responses running beside it, by id
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
        await self.cancel_all()

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> None:
        await self.send({"type": "session.created", "session": self.config.public(self.id)})
        try:
            while not self.closed:
                try:
                    raw = await asyncio.wait_for(receive(), self.limits.idle_timeout_s)
                except asyncio.TimeoutError:  # the builtin only from Python 3.11 on
                    if self.response is not None or self.out_of_band:
                        continue
                    await self.fail(EventError(f"session idle for {self.limits.idle_timeout_s:g} s; closing",
                                               code="idle_timeout", close=True))  # fmt: skip
                    return
                if raw is None:
                    return
                await self.handle(raw)
        finally:
            self.closed = True
            await self.cancel_all()

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
        if self.config.turn_detection["create_response"] and self.response is None:
            messages = self.conversation.messages(self.config.instructions, self.config.prompt_tools)
            await self.start_response(ResponsePlan(messages, self.config, conversation_id=self.conversation.id))

    def _room_for(self, item: AnyItem) -> None:
        limit = self.limits.max_conversation_mb * 2**20
        if self.conversation.nbytes + item.nbytes > limit:
            raise EventError(f"the conversation would hold {(self.conversation.nbytes + item.nbytes) / 2**20:.1f} MiB "
                             f"of text, images and audio, over the limit of {self.limits.max_conversation_mb:g} MiB; "
                             "start a new session", code="conversation_too_large", close=True)  # fmt: skip

    async def _commit(self, pcm: bytes, item_id: str) -> None:
        item = audio_item(pcm)
        item.id = item_id
        self._room_for(item)
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
        self._room_for(item)
        # "" appends, as at OpenAI: clients send it for "no previous item"
        previous = get(event, "previous_item_id", str, required=False) or None
        previous = self.conversation.add(item, previous)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.public()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.public()})

    async def on_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        item = self.conversation.get(get(event, "item_id", str), code="item_retrieve_invalid_item_id")
        await self.send({"type": "conversation.item.retrieved", "item": item.public(self.config.input_format)})

    async def on_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item_id = get(event, "item_id", str)
        if self.conversation.get(item_id, code="item_delete_invalid_item_id").status == "in_progress":
            await self.cancel_response("client_cancelled")  # the conversation's response is generating it
        self.conversation.delete(item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def on_conversation_item_truncate(self, event: dict[str, Any]) -> None:
        item_id, end_ms = get(event, "item_id", str), get(event, "audio_end_ms", int)
        if get(event, "content_index", int, required=False) not in (None, 0):
            raise EventError("an assistant item has one content part: content_index must be 0", param="content_index")
        item = self.conversation.get(item_id, code="item_truncate_invalid_item_id")
        if not isinstance(item, Item) or item.role != "assistant" or not item.audio_out:
            raise EventError("only assistant audio items can be truncated", param="item_id")
        if item.status == "in_progress":
            await self.cancel_response("client_cancelled")  # the listener stopped: generating more is waste
        if not 0 <= end_ms <= item.audio_ms + 1:
            raise EventError(f"audio_end_ms {end_ms} is outside the item's {item.audio_ms:.0f} ms of audio",
                             param="audio_end_ms")  # fmt: skip
        item.truncate(end_ms)
        await self.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                         "audio_end_ms": end_ms})  # fmt: skip

    # ---- responses -------------------------------------------------------------------------------------
    async def on_response_create(self, event: dict[str, Any]) -> None:
        options = get(event, "response", dict, required=False) or {}
        plan = plan_response(options, self.config, self.conversation, self.settings)
        if plan.into_conversation and self.response is not None:
            raise EventError(f"response {self.response.plan.id} is in progress; cancel it or wait for response.done",
                             code="conversation_already_has_active_response")  # fmt: skip
        if not plan.into_conversation and len(self.out_of_band) >= MAX_OUT_OF_BAND:
            raise EventError(f"{MAX_OUT_OF_BAND} out-of-band responses are in progress; cancel one or wait for its "
                             "response.done", code="too_many_active_responses")  # fmt: skip
        await self.start_response(plan)

    async def start_response(self, plan: ResponsePlan) -> None:
        meter = RequestMeter(self.metrics, time.perf_counter(), request_id=plan.id) if self.metrics else None
        response = Response(plan, self.send, meter)
        if plan.into_conversation:
            self.response = response
        else:
            self.out_of_band[plan.id] = response
        response.task = asyncio.create_task(self._respond(response))

    async def _respond(self, response: Response) -> None:
        async def add_item(item: AnyItem) -> None:
            if response.plan.into_conversation:
                previous = self.conversation.add(item)
                await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.public()})

        try:
            outcome = await response.run(self.client, add_item)
        finally:
            if self.response is response:
                self.response = None
            self.out_of_band.pop(response.plan.id, None)
        if not response.plan.into_conversation:
            return
        usage = outcome.usage or {}
        used = int(usage.get("input_tokens", 0)) + int(usage.get("output_token_details", {}).get("text_tokens", 0))
        if used >= self.limits.max_conversation_tokens:
            await self.fail(EventError(f"the conversation holds {used} tokens, the limit is "
                                       f"{self.limits.max_conversation_tokens}; start a new session",
                                       code="conversation_too_long", close=True))  # fmt: skip

    async def on_response_cancel(self, event: dict[str, Any]) -> None:
        """With a response_id, that response (in the conversation or out of band); without, the conversation's."""
        wanted = get(event, "response_id", str, required=False)
        running = {r.plan.id: r for r in (self.response, *self.out_of_band.values()) if r is not None}
        target = self.response if wanted is None else running.get(wanted)
        if target is None:
            raise EventError("no response in progress" if wanted is None else f"response {wanted!r} is not in progress",
                             code="response_cancel_not_active")  # fmt: skip
        await target.cancel("client_cancelled")

    async def cancel_response(self, reason: str) -> None:
        """Cancel the conversation's running response (if any) and wait until its events have ended."""
        if self.response is not None:
            await self.response.cancel(reason)

    async def cancel_all(self) -> None:
        for response in (self.response, *self.out_of_band.values()):
            if response is not None:
                await response.cancel("client_cancelled")
