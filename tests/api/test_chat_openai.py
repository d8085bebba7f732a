# /v1/chat/completions through the openai SDK (sync and async) against uvicorn over the fake backend.
import base64

import numpy as np
import openai
import pytest

from omnistage.core.errors import BadRequestError, EngineError, OverloadedError

from .fake_omni import Script, Step, tone
from .wav_check import expected_pcm16, parse_wav, pcm16_samples

USER = [{"role": "user", "content": "Say hello."}]
AUDIO = [tone(1920, offset=0), tone(3840, offset=1920), tone(960, offset=5760)]


def spoken_script(**kw) -> Script:
    return Script(steps=[Step("Hello"), Step(", ", audio=AUDIO[0]), Step("world", audio=AUDIO[1]), Step("", audio=AUDIO[2])], **kw)


def all_audio() -> np.ndarray:
    return np.concatenate(AUDIO)


# ---- non-streamed ---------------------------------------------------------------------------------------
def test_text_only(openai_client, fake):
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"])
    msg = r.choices[0].message
    assert (msg.role, msg.content, msg.audio) == ("assistant", "Hello world", None)
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion" and r.model == "qwen3-omni"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 11, 18)
    assert fake.calls[0]["parameters"] == {"modalities": "text"}
    assert fake.calls[0]["messages"] == USER and fake.calls[0]["request_id"] == r.id


def test_text_and_audio_wav(openai_client, fake):
    fake.script = spoken_script()
    r = openai_client.chat.completions.create(
        model="qwen3-omni", messages=USER, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}
    )
    msg = r.choices[0].message
    # OpenAI's shape: with audio, the text is the transcript and content stays null
    assert msg.content is None and msg.audio.transcript == "Hello, world"
    assert msg.audio.id.startswith("audio_") and msg.audio.expires_at > r.created
    samples = parse_wav(base64.b64decode(msg.audio.data))
    assert len(samples) == 6720  # 0.28 s at 24 kHz
    np.testing.assert_array_equal(samples, expected_pcm16(all_audio()))
    assert r.usage.completion_tokens_details.audio_tokens == 3
    assert fake.calls[0]["parameters"] == {"modalities": "text,audio", "speaker": "chelsie"}


def test_default_modalities_and_pcm(openai_client, fake):
    fake.script = spoken_script()
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, audio={"voice": "aiden", "format": "pcm16"})
    np.testing.assert_array_equal(pcm16_samples(r.choices[0].message.audio.data), expected_pcm16(all_audio()))
    assert fake.calls[0]["parameters"] == {"modalities": "text,audio", "speaker": "aiden"}


def test_audio_only(openai_client, fake):
    fake.script = spoken_script()
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["audio"])
    msg = r.choices[0].message
    assert msg.content is None and msg.audio.transcript == "Hello, world"
    assert fake.calls[0]["parameters"] == {"modalities": "audio", "speaker": "ethan"}  # the server's default voice


def test_vllm_omni_extras(openai_client, fake):
    openai_client.chat.completions.create(
        model="qwen3-omni", messages=USER, max_completion_tokens=64, temperature=0.0, top_p=0.8, seed=1,
        extra_body={"speaker": "Aiden", "top_k": 20, "sampling_params_list": [
            {"temperature": 0.2, "stop_token_ids": [151645]}, {"temperature": 0.9, "top_k": 50, "max_tokens": 300}, {}]},
    )
    assert fake.calls[0]["parameters"] == {
        "modalities": "text,audio", "speaker": "aiden", "max_tokens": 64, "temperature": 0.0, "top_p": 0.8, "seed": 1,
        "top_k": 20, "stop_token_ids": [151645], "talker_temperature": 0.9, "talker_top_k": 50, "talker_max_tokens": 300,
    }


def test_finish_reason_length(openai_client, fake):
    fake.script = Script(finish_reason="length")
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"], max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_unknown_model(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="gpt-4o", messages=USER)
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("error, status", [(BadRequestError("image too large"), 400), (OverloadedError("queue full"), 503),
                                           (EngineError("thinker crashed"), 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_error_before_output_is_an_http_error(openai_client, fake, error, status, stream):
    # The first backend response is awaited before the 200 is sent, so a streamed request fails the same way.
    fake.script = Script(steps=[], error=error)
    with pytest.raises(openai.APIStatusError) as info:
        r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, stream=stream)
        list(r) if stream else None
    assert info.value.status_code == status
    assert info.value.body["message"] == str(error)
    assert info.value.body["type"] == ("invalid_request_error" if status == 400 else
                                       "service_unavailable_error" if status == 503 else "server_error")


# ---- streamed -------------------------------------------------------------------------------------------
def test_stream_text_and_audio(openai_client, fake):
    fake.script = spoken_script()
    stream = openai_client.chat.completions.create(
        model="qwen3-omni", messages=USER, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # OpenAI streams the spoken text as delta.audio.transcript; content stays null while audio is on
    assert all(d.content is None for d in deltas)
    assert "".join(d.audio.transcript or "" for d in deltas if d.audio) == "Hello, world"
    audio = [d.audio for d in deltas if d.audio is not None and d.audio.data]
    assert len(audio) == 3 and len({d.audio.id for d in deltas if d.audio}) == 1
    # each chunk is raw s16le (no WAV header); the chunks concatenate to the whole utterance
    pcm = np.concatenate([pcm16_samples(a.data) for a in audio])
    np.testing.assert_array_equal(pcm, expected_pcm16(all_audio()))
    assert deltas[-2].audio.expires_at > chunks[0].created and deltas[-2].audio.data is None
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7 + 12
    assert chunks[-1].usage.completion_tokens_details.audio_tokens == 3


def test_stream_text_only_without_usage(openai_client, fake):
    chunks = list(openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert all(c.choices[0].delta.audio is None for c in chunks) and chunks[-1].usage is None
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_raw_sse_framing(http, fake):
    with http.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True, "modalities": ["text"]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])


@pytest.mark.anyio
async def test_async_stream_audio_only(async_openai, fake):
    fake.script = spoken_script()
    stream = await async_openai.chat.completions.create(
        model="qwen3-omni", messages=USER, modalities=["audio"], audio={"voice": "aiden", "format": "pcm16"}, stream=True
    )
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert all(d.content is None for d in deltas)
    assert "".join(d.audio.transcript or "" for d in deltas if d.audio) == "Hello, world"
    pcm = np.concatenate([pcm16_samples(d.audio.data) for d in deltas if d.audio and d.audio.data])
    np.testing.assert_array_equal(pcm, expected_pcm16(all_audio()))
    await async_openai.close()


@pytest.mark.anyio
async def test_async_non_stream(async_openai, fake):
    r = await async_openai.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"])
    assert r.choices[0].message.content == "Hello world"
    await async_openai.close()


def test_error_mid_stream(openai_client, http, fake):
    fake.script = Script(steps=[Step("Hel"), Step("lo", audio=AUDIO[0])], error=EngineError("code2wav failed"))
    got = []
    with pytest.raises(openai.APIError, match="code2wav failed"):
        for c in openai_client.chat.completions.create(model="qwen3-omni", messages=USER, stream=True):
            got.append(c.choices[0].delta.audio)
    assert got[1].transcript == "Hel"
    # on the wire: an error event, then [DONE]
    with http.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"error":{"message":"code2wav failed","type":"server_error"' in events[-2]
    assert http.get("/health").status_code == 200
