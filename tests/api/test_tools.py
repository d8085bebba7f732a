# Tool calls through the openai SDK. The fake backend's reply text holds <tool_call> blocks (the tiny
# checkpoint cannot write one), so what is tested is the frontend's part: the tools in the prompt as the
# released template writes them, the blocks returned as tool_calls (streamed and not), the speech of the text
# before a call kept whole, and the round trip with a `tool` message.
import json

import numpy as np
import pytest

from openai_frontend.tool_calls import ToolCallSplitter

from .fake_omni import Script, Step, tone
from .wav_check import expected_pcm16, pcm16_samples

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calling() -> Script:
    # the call split across deltas, after spoken text; audio keeps coming after the call began: speech lags the
    # text, and omni_ensemble ends the utterance at the call (test_tool_call_unspoken.py), so it is the preamble's
    return Script(steps=[Step("Let me check.", audio=tone(1920)), Step(CALL[:20], audio=tone(1920, offset=1920)),
                         Step(CALL[20:], audio=tone(960, offset=3840)), Step("", audio=tone(960))])


def test_tools_are_in_the_prompt_as_the_released_template_writes_them(openai_client, fake):
    openai_client.chat.completions.create(
        model="qwen3-omni", messages=[{"role": "system", "content": "Be brief."}, *USER], tools=[WEATHER],
        modalities=["text"])
    system = fake.calls[0]["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in system["content"]
    assert fake.calls[0]["messages"][1:] == USER


def test_tool_choice_none_offers_no_tools(openai_client, fake):
    fake.script = Script(steps=[Step(CALL)])
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, tools=[WEATHER], tool_choice="none",
                                              modalities=["text"])  # fmt: skip
    assert fake.calls[0]["messages"] == USER
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == CALL


def test_non_streamed_call(openai_client, fake):
    fake.script = calling()
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, tools=[WEATHER],
                                              audio={"voice": "ethan", "format": "pcm16"})  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert choice.message.audio.transcript == "Let me check."
    # the preamble's speech whole, also what came after the call began
    want = np.concatenate([tone(1920), tone(1920, offset=1920), tone(960, offset=3840), tone(960)])
    np.testing.assert_array_equal(pcm16_samples(choice.message.audio.data), expected_pcm16(want))


def test_streamed_call_and_the_round_trip(openai_client, fake):
    fake.script = calling()
    stream = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, tools=[WEATHER],
                                                   tool_choice="auto", modalities=["text"], stream=True)  # fmt: skip
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    (call,) = [tc for d in deltas for tc in d.tool_calls or ()]
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    fake.script = Script(steps=[Step("It is sunny.")])
    messages = [*USER, {"role": "assistant", "content": "Let me check.", "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=messages, tools=[WEATHER],
                                              modalities=["text"])  # fmt: skip
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    sent = fake.calls[1]["messages"]
    assert sent[2] == {"role": "assistant", "content": "Let me check.\n" + CALL}
    assert sent[3] == {"role": "user", "content": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'}


def test_named_tool_choice_offers_that_tool(openai_client, fake):
    other = {"type": "function", "function": {"name": "get_time"}}
    openai_client.chat.completions.create(model="qwen3-omni", messages=USER, tools=[other, WEATHER], modalities=["text"],
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    system = fake.calls[0]["messages"][0]["content"]
    assert '"get_weather"' in system and '"get_time"' not in system


@pytest.mark.parametrize("deltas, text, names", [
    (["no calls at all"], "no calls at all", []),
    (["a <tool_call>not json</tool_call> b"], "a <tool_call>not json</tool_call> b", []),  # stays text
    (["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool", "_call>{\"name\": \"g\"}</tool_call>"],
     "", ["f", "g"]),
    (["x <tool_call>{\"name\": \"f\""], "x <tool_call>{\"name\": \"f\"", []),  # unclosed at the end: text
])  # fmt: skip
def test_splitter(deltas, text, names):
    splitter = ToolCallSplitter()
    got, calls = "", []
    for d in deltas:
        t, c = splitter.feed(d)
        got, calls = got + t, calls + c
    got += splitter.flush()
    assert got == text and [c["function"]["name"] for c in calls] == names
    assert [c["index"] for c in calls] == list(range(len(names)))


@pytest.mark.parametrize("arguments", ["", "  "])
def test_a_call_with_blank_arguments_renders_an_empty_object(openai_client, fake, arguments):
    fake.script = Script(steps=[Step("Done.")])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{}"}]
    openai_client.chat.completions.create(model="qwen3-omni", messages=messages, tools=[WEATHER], modalities=["text"])
    block = fake.calls[0]["messages"][2]["content"]
    assert block == '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    json.loads(block.split("\n")[1])
