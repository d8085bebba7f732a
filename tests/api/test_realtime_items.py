# Conversation items over /v1/realtime with a scripted backend, driven by the openai SDK's realtime client:
# each audio part of a user item reaches the prompt once and comes back from conversation.item.retrieve in
# the session's format, and response.input's item references resolve against the conversation.
import base64

import numpy as np
import pytest

from openai_frontend.realtime.audio import g711_decode, g711_encode

from .realtime_helpers import fake, sdk, server, until  # noqa: F401

pytestmark = pytest.mark.anyio


def mulaw_tone(seconds: float, f0: float) -> bytes:
    t = np.arange(int(seconds * 8000)) / 8000
    pcm = np.rint(0.3 * 32767 * np.sin(2 * np.pi * f0 * t)).astype(np.int16)
    return g711_encode(pcm, "audio/pcmu")


async def test_audio_parts_reach_the_prompt_once_and_come_back_in_the_session_format(server, fake):
    parts = [mulaw_tone(0.5, 300.0), mulaw_tone(0.25, 500.0)]
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}})
        await until(conn, "session.updated")
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": base64.b64encode(p).decode()} for p in parts]})  # fmt: skip
        added = (await until(conn, "conversation.item.added")).item
        assert [c.audio for c in added.content] == [None, None]  # added and done carry no audio
        await conn.conversation.item.retrieve(item_id=added.id)
        retrieved = (await until(conn, "conversation.item.retrieved")).item
        await conn.response.create()
        await until(conn, "response.done")
    prompt = fake.calls[-1]["messages"][0]["content"]
    assert [len(base64.b64decode(p["input_audio"]["data"])) for p in prompt] == [2 * 8000, 2 * 4000]  # 16 kHz
    for sent, part in zip(parts, retrieved.content):
        back = g711_decode(base64.b64decode(part.audio), "audio/pcmu").astype(np.float32)
        original = g711_decode(sent, "audio/pcmu").astype(np.float32)
        assert part.type == "input_audio" and len(back) == len(original)
        middle = slice(200, len(back) - 200)  # 8 -> 16 -> 8 kHz: the resamplers' edges aside
        assert np.corrcoef(back[middle], original[middle])[0, 1] > 0.99


async def test_response_input_references_conversation_items(server, fake):
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        for text in ("first", "second"):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": text}]})  # fmt: skip
            await until(conn, "conversation.item.done")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "third"}]})  # fmt: skip
        third = (await until(conn, "conversation.item.done")).item
        await conn.response.create(response={"conversation": "none", "input": [
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Judge it."}]},
            {"type": "item_reference", "id": third.id}]})  # fmt: skip
        done = await until(conn, "response.done")
        await conn.response.create(response={"input": [{"type": "item_reference", "id": "item_nope"}]},
                                   event_id="evt_ref")  # fmt: skip
        error = (await until(conn, "error")).error
    assert done.response.conversation_id is None
    assert fake.calls[-1]["messages"] == [{"role": "system", "content": "Judge it."},
                                          {"role": "user", "content": [{"type": "text", "text": "third"}]}]  # fmt: skip
    assert (error.code, error.param, error.event_id) == ("item_not_found", "response.input[0].id", "evt_ref")



async def test_missing_items_get_openais_codes(server, fake):
    """A miss is named per event as OpenAI names it: clients tell a benign race (an item already gone) from a
    fatal error by these codes."""
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.conversation.item.retrieve(item_id="item_gone", event_id="evt_r")
        retrieve = (await until(conn, "error")).error
        await conn.conversation.item.delete(item_id="item_gone", event_id="evt_d")
        delete = (await until(conn, "error")).error
        await conn.conversation.item.truncate(item_id="item_gone", content_index=0, audio_end_ms=0, event_id="evt_t")
        truncate = (await until(conn, "error")).error
    assert [(e.code, e.event_id) for e in (retrieve, delete, truncate)] == [
        ("item_retrieve_invalid_item_id", "evt_r"), ("item_delete_invalid_item_id", "evt_d"),
        ("item_truncate_invalid_item_id", "evt_t")]  # fmt: skip


async def test_an_empty_previous_item_id_appends(server, fake):
    """previous_item_id "" means the end of the conversation, as at OpenAI (clients send it for "none")."""
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        done = []
        for text in ("first", "second"):
            await conn.conversation.item.create(previous_item_id="", item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})  # fmt: skip
            done.append(await until(conn, "conversation.item.done"))
    assert done[0].previous_item_id is None and done[1].previous_item_id == done[0].item.id
