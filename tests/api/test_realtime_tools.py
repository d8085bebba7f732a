# Function calling over /v1/realtime with a scripted backend, driven by the openai SDK's realtime client
# (every server event validated against the SDK's types by `until`): tools and tool_choice in session.update
# and response.create, checked; the reply's <tool_call> blocks as function_call output items after the message
# item; and the round trip, whose next prompt is the one the chat API makes of the same conversation.
import base64
import json

import numpy as np
import pytest

from .fake_omni import Script, Step, tone
from .realtime_helpers import fake, sdk, server, until  # noqa: F401
from .wav_check import expected_pcm16

pytestmark = pytest.mark.anyio
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
# the pipeline ends the talker's utterance where the call begins (omnistage/pipeline/request.py): the audio
# that still comes after the call's text is the speech of "Let me check.", which lags the text
CALLING = Script(steps=[Step("Let me check.", audio=tone(1920)), Step(CALL[:20], audio=tone(1920, offset=1920)),
                        Step(CALL[20:], audio=tone(960, offset=3840)), Step("")])  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset()


async def ask(conn, tools=(WEATHER,), **session):
    await until(conn, "session.created")
    await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "tools": list(tools),
                                       "audio": {"input": {"turn_detection": None}}, **session})  # fmt: skip
    updated = (await until(conn, "session.updated")).session
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": QUESTION}]})  # fmt: skip
    await until(conn, "conversation.item.done")
    return updated


async def test_session_tools_are_checked_shown_and_offered_as_the_chat_api_offers_them(server, fake):
    bad = {
        "session.tools": {"tools": {"name": "f"}},
        "session.tools[0].name": {"tools": [{"type": "function", "name": "no spaces"}]},
        "session.tools[1].name": {"tools": [WEATHER, WEATHER]},
        "session.tools[0].strict": {"tools": [{**WEATHER, "strict": True}]},
        "session.tools[0].parameters": {"tools": [{**WEATHER, "parameters": "object"}]},
        "session.tools[0].type": {"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]},
        "session.tool_choice": {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
    }  # fmt: skip
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        errors = {}
        for param, session in bad.items():
            await conn.session.update(session={"type": "realtime", **session}, event_id=f"evt_{len(errors)}")
            errors[param] = (await until(conn, "error")).error
        for choice in ("required", "sometimes", {"type": "mcp", "server_label": "x"}):
            await conn.session.update(session={"type": "realtime", "tool_choice": choice})
            errors[json.dumps(choice)] = (await until(conn, "error")).error
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "tools": [TIME, WEATHER],
                                           "tool_choice": {"type": "function", "name": "get_weather"}})  # fmt: skip
        updated = (await until(conn, "session.updated")).session
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": QUESTION}]})  # fmt: skip
        await until(conn, "conversation.item.done")
        await conn.response.create(response={"output_modalities": ["text"]})
        await until(conn, "response.done")
    assert [(e.param, e.event_id) for e in list(errors.values())[:len(bad)]] == \
        [(param, f"evt_{i}") for i, param in enumerate(bad)]  # fmt: skip
    assert errors["session.tools[0].type"].code == "unsupported" and "MCP" in errors["session.tools[0].type"].message
    assert [(e.param, e.code) for e in list(errors.values())[len(bad):]] == [
        ("session.tool_choice", "invalid_value"), ("session.tool_choice", "invalid_value"),
        ("session.tool_choice", "unsupported")]  # fmt: skip
    assert [t.name for t in updated.tools] == ["get_time", "get_weather"]
    assert updated.tool_choice.name == "get_weather" and updated.tools[1].parameters == WEATHER["parameters"]
    # a named function is offered alone, in the chat API's shape and place: the end of the system turn
    system = fake.calls[-1]["messages"][0]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    assert system["content"].startswith("Be brief.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(chat_tool, ensure_ascii=False) + "\n</tools>" in system["content"]


async def test_response_create_overrides_the_tools(server, fake):
    fake.script = Script(steps=[Step(CALL)])
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await ask(conn, output_modalities=["text"])
        await conn.response.create(response={"tools": [{"type": "function"}]}, event_id="evt_nameless")
        nameless = (await until(conn, "error")).error
        await conn.response.create(response={"tools": [TIME]})
        await until(conn, "response.done")
        await conn.response.create(response={"tool_choice": "none"})
        plain = (await until(conn, "response.done")).response
    assert (nameless.param, nameless.code, nameless.event_id) == ("response.tools[0].name", "invalid_value", "evt_nameless")
    offered, none = (call["messages"][0]["content"] for call in fake.calls)
    assert '"get_time"' in offered and '"get_weather"' not in offered
    # "none" offers no tools, and a <tool_call> the model writes anyway stays text
    assert none == "Be brief." and [item.type for item in plain.output] == ["message"]
    assert plain.output[0].content[0].text == CALL


async def test_a_spoken_reply_with_a_call_is_a_message_item_then_a_function_call_item(server, fake):
    fake.script = CALLING
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await ask(conn)
        await conn.response.create()
        seen: list = []
        done = (await until(conn, "response.done", seen)).response
    kinds = [e.type for e in seen if e.type not in ("response.output_audio.delta",
                                                    "response.output_audio_transcript.delta")]  # fmt: skip
    assert kinds == [
        "response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done",
        "response.output_item.added", "conversation.item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "conversation.item.done",
        "response.done"]  # fmt: skip
    message, call = done.output
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    assert transcript == message.content[0].transcript == "Let me check."
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), expected_pcm16(tone(4800)))  # all of the preamble
    added = next(e for e in seen if e.type == "response.output_item.added" and e.output_index == 1).item
    assert (added.type, added.status, added.arguments, added.name) == ("function_call", "in_progress", "", "get_weather")
    delta = next(e for e in seen if e.type == "response.function_call_arguments.delta")
    args = next(e for e in seen if e.type == "response.function_call_arguments.done")
    assert (delta.item_id, delta.call_id, delta.output_index) == (call.id, call.call_id, 1)
    assert (args.item_id, args.call_id, args.name, args.arguments) == (call.id, call.call_id, "get_weather", delta.delta)
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert done.status == "completed" and message.status == "completed"


async def test_a_reply_of_calls_only_has_no_message_item(server, fake):
    fake.script = Script(steps=[Step(CALL + "\n"), Step(TIME_CALL)])
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await ask(conn, tools=(WEATHER, TIME), output_modalities=["text"])
        await conn.response.create()
        seen: list = []
        done = (await until(conn, "response.done", seen)).response
        await conn.conversation.item.retrieve(item_id=done.output[1].id)
        retrieved = (await until(conn, "conversation.item.retrieved")).item
    assert [(i.type, i.name) for i in done.output] == [("function_call", "get_weather"), ("function_call", "get_time")]
    assert [e.output_index for e in seen if e.type == "response.output_item.added"] == [0, 1]
    assert not any(e.type.startswith(("response.content_part", "response.output_text")) for e in seen)
    assert retrieved.arguments == "{}" and retrieved.call_id == done.output[1].call_id


async def test_the_round_trip_prompts_as_the_chat_api_does_and_waits_for_response_create(server, fake):
    fake.script = CALLING
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await ask(conn, audio={"input": {"turn_detection": {"type": "server_vad", "create_response": True}}})
        await conn.response.create()
        call = (await until(conn, "response.done")).response.output[1]
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                  "output": '{"sky": "sunny"}'})  # fmt: skip
        seen: list = []
        output = (await until(conn, "conversation.item.done", seen)).item
        # nothing starts by itself after a function_call_output: the next event is the answer to this one
        await conn.conversation.item.retrieve(item_id=output.id)
        await until(conn, "conversation.item.retrieved", seen)
        assert [e.type for e in seen] == ["conversation.item.added", "conversation.item.done",
                                          "conversation.item.retrieved"]  # fmt: skip
        fake.script = Script(steps=[Step("It is sunny.")])
        await conn.response.create()
        answer = (await until(conn, "response.done")).response
    assert (output.type, output.call_id, output.output) == ("function_call_output", call.call_id, '{"sky": "sunny"}')
    assert answer.status == "completed" and answer.output[0].content[0].transcript == "It is sunny."
    prompt = fake.calls[-1]["messages"]
    assert prompt[2] == {"role": "assistant", "content": "Let me check.\n" + CALL}
    assert prompt[3] == {"role": "user", "content": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'}

    # the chat API, given the same conversation, sends the same prompt
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    # closed here: its HTTP connection is bound to this test's event loop, which ends with the test
    async with sdk(server.url) as client:
        await client.chat.completions.create(model="qwen3-omni", tools=[chat_tool], modalities=["text"], messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}])  # fmt: skip
    assert fake.calls[-1]["messages"] == prompt


async def test_clients_replay_calls_into_the_history(server, fake):
    """Frameworks rebuild a conversation from their own history: function_call items from the client, calls of
    one turn in one assistant turn, their outputs in one user turn; malformed items are refused."""
    replayed = [{"type": "function_call", "call_id": "call_w", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "call_t", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_w", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_t", "output": "noon"}]  # fmt: skip
    bad = {"item.name": {"type": "function_call", "arguments": "{}"},
           "item.arguments": {"type": "function_call", "name": "f", "arguments": {"city": "Paris"}},
           "item.call_id": {"type": "function_call_output", "output": "x"},
           "item.type": {"type": "mcp_call", "id": "x"}}  # fmt: skip
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await ask(conn, tools=(WEATHER, TIME), output_modalities=["text"])
        for item in replayed:
            await conn.conversation.item.create(item=item)
            await until(conn, "conversation.item.done")
        errors = []
        for item in bad.values():
            await conn.conversation.item.create(item=item)
            errors.append((await until(conn, "error")).error)
        await conn.response.create()
        assert (await until(conn, "response.done")).response.status == "completed"
    assert [e.param for e in errors] == list(bad) and errors[-1].code == "unsupported"
    assert fake.calls[-1]["messages"][2:] == [
        {"role": "assistant", "content": CALL + "\n" + TIME_CALL},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"}]
