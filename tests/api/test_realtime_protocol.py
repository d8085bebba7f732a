# /v1/realtime over a scripted backend, driven by the openai SDK's realtime client (and a raw WebSocket
# where the SDK cannot send what is tested): the GA events of a response, server VAD turns, barge-in,
# truncation, manual commits, G.711, the API key, bad events, and each limit's error and close.
import asyncio
import base64
import json

import numpy as np
import pytest
import websockets

from openai_frontend.realtime.audio import g711_decode
from openai_frontend.realtime.connection import RealtimeLimits

from .fake_omni import FakeOmniClient, Script, Step, tone
from .realtime_helpers import KEY, WAIT_S, fake, sdk, serve, server, stream_audio, until, utterance  # noqa: F401
from .wav_check import expected_pcm16

pytestmark = pytest.mark.anyio
SPOKEN = Script(steps=[Step("Hi", audio=tone(1920 * 2)), Step(" there", audio=tone(1920 * 3, offset=3840)),
                       Step("!", audio=tone(1920, offset=9600))])  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()
    fake.script = SPOKEN


def ws_url(server, model: str = "qwen3-omni") -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime?model={model}"


async def test_text_item_then_response_streams_ga_events(server, fake):
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        created = await until(conn, "session.created")
        assert created.session.type == "realtime" and created.session.audio.output.voice == "ethan"
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"output": {"voice": "Chelsie"}}})  # fmt: skip
        updated = await until(conn, "session.updated")
        assert updated.session.instructions == "Be brief." and updated.session.audio.output.voice == "chelsie"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello?"}]})  # fmt: skip
        added = await until(conn, "conversation.item.added")
        await until(conn, "conversation.item.done")
        await conn.response.create()
        seen: list = []
        done = await until(conn, "response.done", seen)
    kinds = [e.type for e in seen]
    assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]  # fmt: skip
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    assert transcript == "Hi there!"
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), expected_pcm16(tone(1920 * 6)))
    assert done.response.status == "completed" and done.response.output[0].content[0].transcript == "Hi there!"
    assert done.response.usage.input_tokens == 7 and done.response.usage.output_token_details.audio_tokens == 6
    call = fake.calls[-1]
    assert call["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]  # fmt: skip
    assert call["parameters"] == {"modalities": "text,audio", "speaker": "chelsie", "chunk_schedule": "playback"}
    assert added.item.content[0].text == "Hello?"


async def test_openai_voice_names_are_echoed_and_spoken_in_the_default_voice(server, fake):
    """LiveKit's and Pipecat's OpenAI realtime plugins send one of OpenAI's voices in their first
    session.update: the update is taken whole, the name echoed, the speech in the server's default voice."""
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"output": {"voice": "marin"}}})  # fmt: skip
        updated = await until(conn, "session.updated")
        assert updated.session.audio.output.voice == "marin" and updated.session.instructions == "Be brief."
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello?"}]})  # fmt: skip
        await until(conn, "conversation.item.done")
        await conn.response.create()
        first = await until(conn, "response.done")
        await conn.response.create(response={"audio": {"output": {"voice": "Alloy"}}})
        second = await until(conn, "response.done")
    assert (first.response.audio.output.voice, second.response.audio.output.voice) == ("marin", "alloy")
    assert [call["parameters"]["speaker"] for call in fake.calls] == ["ethan", "ethan"]


async def test_server_vad_turn_commits_audio_and_answers(server, fake):
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await stream_audio(conn, utterance(1.0))
        started = await until(conn, "input_audio_buffer.speech_started")
        stopped = await until(conn, "input_audio_buffer.speech_stopped")
        committed = await until(conn, "input_audio_buffer.committed")
        done = await until(conn, "response.done")
    assert started.item_id == stopped.item_id == committed.item_id
    assert 0 <= started.audio_start_ms <= 200 < stopped.audio_end_ms
    assert done.response.status == "completed"
    (part,) = fake.calls[-1]["messages"][0]["content"]
    audio = base64.b64decode(part["input_audio"]["data"])
    assert part["input_audio"]["format"] == "pcm"  # 16 kHz s16le, the model's rate
    # the item holds the speech from its start (with prefix padding) to where the silence ended the turn
    assert len(audio) // 2 == pytest.approx((stopped.audio_end_ms - started.audio_start_ms) * 16, abs=16 * 40)



async def test_semantic_vad_is_served_by_the_server_vad(server, fake):
    """LiveKit's OpenAI plugin asks for semantic_vad by default: the update is taken whole and shown as asked,
    and the server VAD takes the turns, its silence set by eagerness (high: 300 ms)."""
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "semantic_vad", "eagerness": "fast"}}}}, event_id="evt_eager")  # fmt: skip
        eager = (await until(conn, "error")).error
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "high", "create_response": True,
                               "interrupt_response": True}}}})  # fmt: skip
        updated = (await until(conn, "session.updated")).session
        await stream_audio(conn, utterance(1.0))  # speech from 200 ms to 1200 ms
        stopped = await until(conn, "input_audio_buffer.speech_stopped")
        done = await until(conn, "response.done")
    assert (eager.param, eager.event_id) == ("session.audio.input.turn_detection.eagerness", "evt_eager")
    assert updated.instructions == "Be brief."
    assert updated.audio.input.turn_detection.model_dump(exclude_none=True) == {
        "type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
    assert 1200 + 300 - 100 <= stopped.audio_end_ms < 1200 + 500  # shorter than server_vad's default silence
    assert done.response.status == "completed"

async def test_barge_in_cancels_the_response_and_truncate_cuts_the_transcript(server, fake):
    fake.script = Script(steps=[Step("a", audio=tone(1920)), Step("b", audio=tone(1920)), Step("c", audio=tone(1920)),
                                Step("d")], hang=True)  # fmt: skip
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await stream_audio(conn, utterance(1.0))
        seen: list = []
        await until(conn, "response.output_audio_transcript.delta", seen)
        response_id = seen[0].response.id if seen[0].type == "response.created" else None
        await until(conn, "response.output_audio.delta")
        await stream_audio(conn, utterance(0.6, silence_s=0.0, f0=190.0))  # the user speaks over it
        seen = []
        done = await until(conn, "response.done", seen)
        assert fake.cancelled.wait(WAIT_S)  # the backend request was cancelled
        assert "input_audio_buffer.speech_started" in [e.type for e in seen]
        assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
        assert response_id in (None, done.response.id)
        item = done.response.output[0]
        assert item.status == "incomplete" and item.content[0].transcript == "abcd"
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=100)
        truncated = await until(conn, "conversation.item.truncated")
        assert truncated.audio_end_ms == 100
        await conn.conversation.item.retrieve(item_id=item.id)
        retrieved = await until(conn, "conversation.item.retrieved")
    # 100 ms of audio is within the second codec frame: the first two reply tokens were spoken
    assert retrieved.item.content[0].transcript == "ab"


async def test_manual_commit_and_response_cancel(server, fake):
    fake.script = Script(steps=[Step("x", audio=tone(1920))], hang=True)
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = await until(conn, "session.updated")
        assert updated.session.audio.input.turn_detection is None
        await stream_audio(conn, utterance(1.0))
        await conn.input_audio_buffer.commit()
        committed = await until(conn, "input_audio_buffer.committed")
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 5})
        await until(conn, "response.output_text.delta")
        await conn.response.create()  # a second one while the first runs
        error = await until(conn, "error")
        assert error.error.code == "conversation_already_has_active_response"
        await conn.response.cancel()
        done = await until(conn, "response.done")
        await conn.input_audio_buffer.commit()  # nothing left in the buffer
        empty = await until(conn, "error")
    assert empty.error.code == "input_audio_buffer_commit_empty"
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
    assert fake.cancelled.wait(WAIT_S)
    assert fake.calls[-1]["parameters"] == {"modalities": "text", "max_tokens": 5}
    audio = base64.b64decode(fake.calls[-1]["messages"][0]["content"][0]["input_audio"]["data"])
    assert len(audio) == 2 * 16000 * 2  # all 2 s the client sent (0.2 + 1.0 + 0.8), at 16 kHz
    assert committed.item_id


async def test_g711_in_and_out(server, fake):
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}}}})  # fmt: skip
        await until(conn, "session.updated")
        await conn.input_audio_buffer.append(audio=base64.b64encode(bytes([0xFF] * 8000)).decode())  # 1 s at 8 kHz
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
        await conn.response.create()
        seen: list = []
        await until(conn, "response.done", seen)
    audio = g711_decode(b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta"),
                        "audio/pcma")  # fmt: skip
    assert abs(len(audio) - 1920 * 6 // 3) <= 8  # 24 kHz -> 8 kHz
    t = np.arange(len(audio)) / 8000
    reference = 0.5 * 32767 * np.sin(2 * np.pi * 440 * t)
    middle = slice(100, len(audio) - 100)  # the resampler's edges aside, the tone survives A-law at 8 kHz
    assert np.corrcoef(audio[middle], reference[middle])[0, 1] > 0.98
    sent = base64.b64decode(fake.calls[-1]["messages"][0]["content"][0]["input_audio"]["data"])
    assert len(sent) == 2 * 16000 and not np.frombuffer(sent, "<i2").any()  # mu-law 0xFF is silence


async def test_bad_events_get_errors_and_the_session_lives_on(server):
    async with websockets.connect(ws_url(server), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"

        async def answer(raw: str) -> dict:
            await ws.send(raw)
            return json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))

        assert (await answer("{not json"))["error"]["code"] == "invalid_json"
        e = await answer(json.dumps({"type": "session.fly", "event_id": "evt_1"}))
        assert (e["error"]["code"], e["error"]["event_id"], e["error"]["param"]) == ("unknown_event_type", "evt_1", "type")
        e = await answer(json.dumps({"type": "session.update", "event_id": "evt_2",
                                     "session": {"audio": {"output": {"voice": "albert"}}}}))  # fmt: skip
        assert (e["error"]["code"], e["error"]["param"], e["error"]["event_id"]) == \
            ("invalid_voice", "session.audio.output.voice", "evt_2")  # fmt: skip
        e = await answer(json.dumps({"type": "input_audio_buffer.append", "event_id": "evt_3", "audio": "%%%"}))
        assert e["error"]["code"] == "invalid_base64" and e["error"]["event_id"] == "evt_3"
        e = await answer(json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 5}))
        assert e["error"]["code"] == "item_truncate_invalid_item_id"
        e = await answer(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad", "threshold": 7}}}}}))  # fmt: skip
        assert e["error"]["param"] == "session.audio.input.turn_detection.threshold"
        e = await answer(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": ["high"]}}}}}))  # fmt: skip
        assert e["error"]["param"] == "session.audio.input.turn_detection.eagerness", e
        e = await answer(json.dumps({"type": "session.update", "session": "realtime"}))
        assert (e["error"]["code"], e["error"]["message"]) == ("invalid_type", "'session' must be an object"), e
        e = await answer(json.dumps({"type": "response.cancel"}))
        assert e["error"]["code"] == "response_cancel_not_active"
        e = await answer(json.dumps({"type": "response.create"}))
        assert e["error"]["code"] == "empty_conversation"
        # a lone surrogate (JSON may escape one) can be echoed in no event: refused, not echoed
        for raw in ('{"type":"session.update","session":{"instructions":"\\ud800"}}',
                    '{"type":"response.cancel","event_id":"\\udc00"}',
                    '{"type":"conversation.item.create","item":{"type":"message","role":"user",'
                    '"content":[{"type":"input_text","text":"a\\ud800"}]}}'):  # fmt: skip
            e = await answer(raw)
            assert e["error"]["code"] == "invalid_value" and "surrogate" in e["error"]["message"], e
        # still serving: a valid update is applied, and the failed ones changed nothing
        e = await answer(json.dumps({"type": "session.update", "session": {"instructions": "ok"}}))
        assert e["type"] == "session.updated" and e["session"]["audio"]["output"]["voice"] == "ethan"
        assert e["session"]["audio"]["input"]["turn_detection"]["threshold"] == 0.5


async def test_api_key_header_or_browser_subprotocol(server):
    with pytest.raises(Exception) as refused:
        async with sdk(server.url, key="wrong").realtime.connect(model="qwen3-omni") as conn:
            await conn.recv()
    assert "401" in str(refused.value)
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with websockets.connect(ws_url(server), subprotocols=protocols) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"


async def test_unknown_model_is_an_error_and_a_close(server):
    async with websockets.connect(ws_url(server, "gpt-realtime"), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        e = json.loads(await ws.recv())
        assert e["error"]["code"] == "model_not_found"
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT_S)
    assert ws.close_code == 1008


async def test_client_leaving_mid_response_cancels_the_backend(server, fake):
    fake.script = Script(steps=[Step("x", audio=tone(1920))], hang=True)
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Talk."}]})  # fmt: skip
        await conn.response.create()
        await until(conn, "response.output_audio.delta")
    assert fake.cancelled.wait(WAIT_S)


# ---- limits: each an error event, then a clean close -------------------------------------------------------
async def closed_after_error(url: str, send=None) -> tuple[dict, int]:
    async with websockets.connect(f"ws://{url.split('://')[1]}/v1/realtime",
                                  additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:  # fmt: skip
        async with asyncio.timeout(WAIT_S):
            if send is not None:
                await send(ws)
            while (event := json.loads(await ws.recv()))["type"] != "error":
                pass
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await ws.recv()
    return event["error"], ws.close_code


async def test_max_sessions():
    with serve(FakeOmniClient(), RealtimeLimits(max_sessions=1)) as srv:
        async with sdk(srv.url).realtime.connect(model="qwen3-omni") as first:
            await until(first, "session.created")
            error, code = await closed_after_error(srv.url)
            assert error["code"] == "server_overloaded" and code == 1013
        await asyncio.sleep(0.2)  # the earlier session has closed: a new one is served
        async with sdk(srv.url).realtime.connect(model="qwen3-omni") as again:
            assert (await until(again, "session.created")).type == "session.created"


async def test_idle_timeout():
    with serve(FakeOmniClient(), RealtimeLimits(idle_timeout_s=0.5)) as srv:
        error, code = await closed_after_error(srv.url)
    assert error["code"] == "idle_timeout" and code == 1008


async def test_max_buffered_audio():
    async def flood(ws):
        for _ in range(3):  # 3 x 0.5 s against a 1 s limit, no turn detection to commit it
            await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(24000)).decode()}))

    with serve(FakeOmniClient(), RealtimeLimits(max_buffered_audio_s=1.0)) as srv:
        error, code = await closed_after_error(srv.url, flood)
    assert error["code"] == "input_audio_buffer_too_large" and code == 1008


async def test_max_conversation_tokens():
    async def ask(ws):
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}))  # fmt: skip
        await ws.send(json.dumps({"type": "response.create"}))

    fake = FakeOmniClient()  # 7 prompt tokens + 11 reply tokens ("Hello world") against a limit of 10
    with serve(fake, RealtimeLimits(max_conversation_tokens=10)) as srv:
        error, code = await closed_after_error(srv.url, ask)
    assert error["code"] == "conversation_too_long" and code == 1008


async def test_max_conversation_mb():
    # items alone, with no response asked for (the token limit is checked only after one): each 0.4 MiB of text
    # against a 1 MiB limit; the third is refused and the session closed instead of growing without bound
    async def add(ws):
        for _ in range(3):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a" * (400 << 10)}]}}))

    fake = FakeOmniClient()
    with serve(fake, RealtimeLimits(max_conversation_mb=1.0)) as srv:
        error, code = await closed_after_error(srv.url, add)
    assert error["code"] == "conversation_too_large" and code == 1008
    assert fake.calls == []


async def test_max_conversation_mb_counts_committed_audio_and_frees_deleted_items():
    second = base64.b64encode(bytes(48000)).decode()  # 1 s at 24 kHz: 32 KB as the model hears it (16 kHz)

    async def commit_and_delete(ws):
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
        for i in range(40):  # 40 x 32 KB in all against a 0.25 MiB limit: fine while each is deleted again
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while (event := json.loads(await ws.recv()))["type"] != "input_audio_buffer.committed":
                assert event["type"] != "error", event
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": event["item_id"]}))
        for _ in range(10):  # kept: the limit is reached
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

    with serve(FakeOmniClient(), RealtimeLimits(max_conversation_mb=0.25)) as srv:
        error, code = await closed_after_error(srv.url, commit_and_delete)
    assert error["code"] == "conversation_too_large" and code == 1008
