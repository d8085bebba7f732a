# /v1/realtime against the GA Realtime protocol over the real pipeline (tiny checkpoint, real tritonserver,
# `python -m openai_frontend`), driven by the openai SDK's realtime client: a voice-agent framework's
# session (LiveKit / Pipecat: one full session.update with manual turns, then append, commit, create),
# item retrieval with its audio, truncation and deletion, an out-of-band response with per-response
# overrides beside the conversation's own, response.cancel with and without a response id, and a tool turn.
import asyncio
import base64
import time

import numpy as np
import pytest

from .realtime_helpers import sdk, stream_audio, until, utterance
from .test_realtime_triton import ENDLESS, SHORT, TURN_S, anyio_backend, frontend, held, metrics, triton  # noqa: F401

pytestmark = pytest.mark.anyio
FREE_WITHIN_S = 10  # a bound for the wait, not a speed claim: the barge-in test owns the 1 s figure

# what a GA client framework sends first: every field, transcription and noise reduction off, manual turns
AGENT_SESSION = {
    "type": "realtime", "model": "qwen3-omni", "output_modalities": ["audio"], "instructions": "Be brief.",
    "tools": [], "tool_choice": "auto", "tracing": None, "truncation": "auto", "prompt": None, "include": None,
    "max_output_tokens": "inf",
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": None, "noise_reduction": None,
                        "turn_detection": None},
              "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ethan", "speed": 1.0}},
    "sampling_params_list": SHORT,
}  # fmt: skip


async def test_agent_framework_session_with_manual_turns(frontend):
    pcm = utterance(1.0)
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session=AGENT_SESSION)
        session = (await until(conn, "session.updated")).session
        assert session.audio.input.turn_detection is None and session.max_output_tokens == "inf"
        assert session.audio.input.format.rate == session.audio.output.format.rate == 24000
        await stream_audio(conn, pcm)
        await conn.input_audio_buffer.commit()
        committed = await until(conn, "input_audio_buffer.committed")
        await conn.response.create()
        seen: list = []
        done = await until(conn, "response.done", seen, timeout=TURN_S)
        response = done.response
        assert response.status == "completed", response.status_details
        created = next(e for e in seen if e.type == "response.created").response
        assert response.conversation_id == created.conversation_id and response.conversation_id.startswith("conv_")
        assert response.audio.output.format.type == "audio/pcm" and response.audio.output.format.rate == 24000
        usage = response.usage
        assert usage.output_tokens == usage.output_token_details.text_tokens + usage.output_token_details.audio_tokens
        assert usage.output_token_details.text_tokens == 4 and usage.output_token_details.audio_tokens == 20
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens > usage.output_tokens
        details = usage.input_token_details
        assert details.text_tokens + details.audio_tokens + details.image_tokens == usage.input_tokens
        assert details.cached_tokens_details.text_tokens == details.cached_tokens

        # the user item comes back with its audio: what the model heard, in the session's format
        await conn.conversation.item.retrieve(item_id=committed.item_id)
        user = (await until(conn, "conversation.item.retrieved")).item
        heard = np.frombuffer(base64.b64decode(user.content[0].audio), "<i2").astype(np.float32)
        sent = np.frombuffer(pcm, "<i2").astype(np.float32)
        assert user.content[0].type == "input_audio" and len(heard) == len(sent)
        middle = slice(2400, len(sent) - 2400)  # 24 -> 16 -> 24 kHz: the resamplers' edges aside
        assert np.corrcoef(heard[middle], sent[middle])[0, 1] > 0.99

        # truncation at the start leaves nothing of the reply heard; past the audio's end it is refused
        reply = response.output[0]
        assert reply.content[0].type == "output_audio" and reply.content[0].transcript
        await conn.conversation.item.truncate(item_id=reply.id, content_index=0, audio_end_ms=60_000, event_id="evt_long")
        error = (await until(conn, "error")).error
        assert (error.param, error.event_id) == ("audio_end_ms", "evt_long")
        await conn.conversation.item.truncate(item_id=reply.id, content_index=0, audio_end_ms=0)
        assert (await until(conn, "conversation.item.truncated")).audio_end_ms == 0
        await conn.conversation.item.retrieve(item_id=reply.id)
        cut = (await until(conn, "conversation.item.retrieved")).item
        assert cut.status == "incomplete" and cut.content[0].transcript == ""

        await conn.conversation.item.delete(item_id=committed.item_id)
        assert (await until(conn, "conversation.item.deleted")).item_id == committed.item_id
        await conn.conversation.item.retrieve(item_id=committed.item_id, event_id="evt_gone")
        error = (await until(conn, "error")).error
        assert (error.code, error.param, error.event_id) == ("item_retrieve_invalid_item_id", "item_id", "evt_gone")


async def test_a_tool_turn_renders_and_is_answered(frontend):
    """Tools in the session and a call's output in the conversation reach the model as a prompt it reads: the
    tiny checkpoint writes no call itself, so the client replays one (as frameworks replay history)."""
    weather = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'}]  # fmt: skip
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={**AGENT_SESSION, "tools": [weather], "output_modalities": ["text"]})
        assert (await until(conn, "session.updated")).session.tools[0].name == "get_weather"
        for item in items:
            await conn.conversation.item.create(item=item)
            await until(conn, "conversation.item.done")
        await conn.response.create(response={"conversation": "none", "tool_choice": "none"})
        untooled = (await until(conn, "response.done", timeout=TURN_S)).response
        await conn.response.create()
        answer = (await until(conn, "response.done", timeout=TURN_S)).response
    assert answer.status == untooled.status == "completed", answer.status_details
    assert answer.usage.output_token_details.text_tokens == 4
    # the same conversation, with the tools' block in its system turn
    assert answer.usage.input_tokens > untooled.usage.input_tokens + 50


async def endless_session(conn, text: str):
    """Long spoken answers (stopped only by a cancel) to a conversation of one user text; that item."""
    await until(conn, "session.created")
    await conn.session.update(session={"type": "realtime", "sampling_params_list": ENDLESS})
    await until(conn, "session.updated")
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})  # fmt: skip
    return (await until(conn, "conversation.item.done")).item


async def test_out_of_band_response_beside_the_conversations_own(frontend):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        user = await endless_session(conn, "Hello?")
        await conn.send({"type": "response.create", "event_id": "evt_odd", "response": {"temperature": 0.3}})
        error = (await until(conn, "error")).error
        assert (error.code, error.param, error.event_id) == ("unknown_parameter", "response.temperature", "evt_odd")
        await conn.response.create()  # the conversation's own: a long spoken answer
        spoken = (await until(conn, "response.created")).response.id
        await until(conn, "response.content_part.added", timeout=TURN_S)
        await conn.response.create(response={
            "conversation": "none", "output_modalities": ["text"], "instructions": "Answer in one word.",
            "max_output_tokens": 3, "metadata": {"purpose": "classify"},
            "input": [{"type": "item_reference", "id": user.id}]})  # fmt: skip
        seen: list = []
        done = await until(conn, "response.done", seen, timeout=TURN_S)
        response = done.response
        assert response.id != spoken and response.conversation_id is None
        assert response.metadata == {"purpose": "classify"} and response.output_modalities == ["text"]
        assert (response.status, response.status_details.reason) == ("incomplete", "max_output_tokens")
        assert response.usage.output_token_details.text_tokens == 3
        assert response.usage.output_token_details.audio_tokens == 0
        mine = [e for e in seen if getattr(e, "response_id", None) == response.id]
        text = "".join(e.delta for e in mine if e.type == "response.output_text.delta")
        assert response.output[0].content[0].type == "output_text" and response.output[0].content[0].text == text
        assert not any("audio" in e.type for e in mine) and not any(e.type.startswith("conversation.") for e in seen)
        assert any(getattr(e, "response_id", None) == spoken for e in seen)  # the spoken answer ran on meanwhile
        await conn.conversation.item.retrieve(item_id=response.output[0].id)  # kept out of the conversation
        assert (await until(conn, "error")).error.code == "item_retrieve_invalid_item_id"
        await conn.response.cancel()  # no id: the conversation's response
        done = await until(conn, "response.done", timeout=TURN_S)
    assert (done.response.id, done.response.status) == (spoken, "cancelled")


async def cancelled(conn, triton, response_id: str | None) -> None:
    """Cancel the running response (by id or not) and see it end cancelled with every stage freed."""
    await conn.response.cancel(**({"response_id": response_id} if response_id else {}))
    done = await until(conn, "response.done", timeout=TURN_S)
    assert (done.response.status, done.response.status_details.reason) == ("cancelled", "client_cancelled")
    assert done.response.output[0].status == "incomplete"
    deadline = time.monotonic() + FREE_WITHIN_S
    while any((now := held(metrics(triton))).values()):
        assert time.monotonic() < deadline, f"still held after the cancel: {now}"
        await asyncio.sleep(0.1)


async def test_response_cancel_with_and_without_an_id(frontend, triton):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await endless_session(conn, "Talk.")
        for by_id in (True, False):
            await conn.response.create()
            created = await until(conn, "response.created")
            await until(conn, "response.output_audio.delta", timeout=TURN_S)
            if by_id:
                await conn.response.cancel(response_id="resp_other", event_id="evt_other")
                error = (await until(conn, "error")).error
                assert (error.code, error.event_id) == ("response_cancel_not_active", "evt_other")
            await cancelled(conn, triton, created.response.id if by_id else None)
