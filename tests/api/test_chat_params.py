# Request -> omni_ensemble parameters, without HTTP.
import asyncio

import pytest
from pydantic import ValidationError

from omnistage.core.errors import BadRequestError
from omnistage.core.protocol import OMNI
from openai_frontend.chat_params import plan_chat
from openai_frontend.schemas import ChatCompletionRequest
from openai_frontend.settings import FrontendSettings


def plan_now(*args):
    return asyncio.run(plan_chat(*args))


SETTINGS = FrontendSettings(default_voice="chelsie")
USER = [{"role": "user", "content": "hi"}]


def plan(**body):
    return plan_now(ChatCompletionRequest.model_validate({"messages": USER, **body}), SETTINGS)


def test_defaults_are_text_and_audio_with_the_default_voice():
    p = plan()
    assert p.parameters == {"modalities": "text,audio", "speaker": "chelsie"}
    assert (p.text_out, p.audio_out, p.audio_format, p.stream, p.include_usage) == (True, True, "wav", False, False)


@pytest.mark.parametrize("modalities, wire", [(["text"], "text"), (["audio"], "audio"), (["audio", "text"], "text,audio")])
def test_modalities(modalities, wire):
    p = plan(modalities=modalities)
    assert p.parameters["modalities"] == wire
    assert ("speaker" in p.parameters) == ("audio" in modalities)


@pytest.mark.parametrize("body, voice", [
    ({"audio": {"voice": "AIDEN", "format": "wav"}}, "aiden"),
    ({"speaker": "Ethan"}, "ethan"),
    ({"voice": "aiden"}, "aiden"),
    ({"audio": {"voice": "ethan"}, "speaker": "aiden"}, "ethan"),  # audio.voice wins
    ({"audio": {"voice": {"id": "Chelsie"}, "format": "pcm16"}}, "chelsie"),
    ({"audio": {"voice": "Alloy", "format": "wav"}}, "chelsie"),  # OpenAI's built-in names: the default voice
    ({"audio": {"voice": "marin"}, "speaker": "aiden"}, "chelsie"),
])
def test_voice_sources(body, voice):
    assert plan(**body).parameters["speaker"] == voice


def test_sampling_and_stage_lists():
    p = plan(
        max_tokens=10, max_completion_tokens=20, temperature=0.7, top_p=0.9, seed=5,
        sampling_params_list=[
            {"temperature": 0.0, "top_k": -1, "max_tokens": 99, "detokenize": True, "stop_token_ids": [151645]},
            {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05, "max_tokens": 4096},
            {"temperature": 0.0},  # code2wav: nothing to sample
        ],
    )
    assert p.parameters == {
        "modalities": "text,audio", "speaker": "chelsie",
        "temperature": 0.7, "top_k": -1, "max_tokens": 20, "stop_token_ids": [151645], "top_p": 0.9, "seed": 5,
        "talker_temperature": 0.9, "talker_top_k": 50, "talker_repetition_penalty": 1.05, "talker_max_tokens": 4096,
    }
    assert set(p.parameters) <= set(OMNI.parameters)


def test_every_sampling_field_is_a_contract_parameter():
    full = {
        "max_tokens": 1, "min_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": 1, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "ignore_eos": False, "stop_token_ids": [1],
    }
    p = plan(**full, sampling_params_list=[None, full])
    assert set(p.parameters) <= set(OMNI.parameters)
    assert len(p.parameters) == 2 + 2 * len(full)


def test_messages_are_forwarded_as_sent():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}, "extra": 1},
        ]},
    ]
    p = plan_now(ChatCompletionRequest.model_validate({"messages": messages}), SETTINGS)
    assert p.messages == messages


def test_stream_options():
    assert plan(stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(ValidationError, match="only allowed when stream"):
        plan(stream_options={"include_usage": True})


@pytest.mark.parametrize("body, param", [
    ({"audio": {"voice": "albert", "format": "wav"}}, "audio.voice"),
    ({"speaker": "nobody"}, "speaker"),
    ({"voice": "alloy"}, "voice"),  # vLLM-Omni's fields take the checkpoint's voices only, as vLLM-Omni does
    ({"speaker": "ethan", "voice": "x"}, "voice"),  # a bad one is an error even when another one is used
])
def test_unknown_voice_lists_the_served_ones(body, param):
    settings = FrontendSettings(voices=("Ethan", "chelsie"))
    with pytest.raises(BadRequestError) as info:
        plan_now(ChatCompletionRequest.model_validate({"messages": USER, **body}), settings)
    assert (info.value.code, info.value.param, info.value.error_code) == (400, param, "invalid_voice")
    assert str(info.value).endswith("valid voices: ethan, chelsie")


def test_voices_come_from_the_settings():
    settings = FrontendSettings(voices=("vivian", "ethan"), default_voice="Vivian")
    p = plan_now(ChatCompletionRequest.model_validate({"messages": USER, "voice": "VIVIAN"}), settings)
    assert p.parameters["speaker"] == "vivian"


@pytest.mark.parametrize("body", [
    {"audio": {"voice": "ethan", "format": "aac"}},
    {"modalities": []},
    {"modalities": ["text", "text"]},
    {"modalities": ["image"]},
    {"temperature": "0.5"},
    {"temperature": 3},
    {"max_tokens": 0},
    {"max_tokens": 1.5},
    {"seed": 2**64},
    {"n": 2},
    {"stop": ""},
    {"stop": ["a", "b", "c", "d", "e"]},
    {"response_style": "anthropic"},
    {"sampling_params_list": [{"max_token": 3}]},
    {"sampling_params_list": [{}, {}, {}, {}]},
])
def test_invalid_requests(body):
    with pytest.raises(ValidationError):
        plan(**body)


def test_default_voice_is_validated():
    with pytest.raises(ValueError, match="default_voice"):
        FrontendSettings(default_voice="alloy")
