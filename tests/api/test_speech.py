# POST /v1/audio/speech through the openai SDK and raw HTTP over the fake backend: a read-aloud chat
# request underneath, every format decoded, pcm streamed as it comes, bad input 400, disconnect cancels.
import time

import httpx
import numpy as np
import pytest

from .fake_omni import Script, Step, tone
from .wav_check import decode_any, expected_pcm16

CHUNKS = [tone(1920 * 4), tone(1920 * 25, offset=1920 * 4)]


def spoken(delay_s: float = 0.0) -> Script:
    return Script(steps=[Step("Hello", audio=CHUNKS[0]), Step(" there", audio=CHUNKS[1], delay_s=delay_s)])


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav", "pcm"])
def test_every_format(openai_client, fake, fmt):
    fake.script = spoken()
    data = openai_client.audio.speech.create(model="qwen3-omni", voice="Aiden", input="Hello there",
                                             response_format=fmt).read()  # fmt: skip
    samples, rate = decode_any(data, fmt)
    assert rate == 24000 and abs(len(samples) - 29 * 1920) <= (0 if fmt in ("wav", "pcm", "flac") else 2400)
    if fmt in ("wav", "pcm", "flac"):
        np.testing.assert_array_equal(samples.astype(np.int16), expected_pcm16(np.concatenate(CHUNKS)))
    call = fake.calls[0]
    assert call["parameters"] == {"modalities": "audio", "speaker": "aiden"}
    assert [m["role"] for m in call["messages"]] == ["system", "user"] and call["messages"][1]["content"] == "Hello there"


def test_openai_voice_names_speak_in_the_default_voice(openai_client, fake):
    fake.script = spoken()
    # the openai SDK requires a voice, and examples written for OpenAI pass one of its own
    openai_client.audio.speech.create(model="qwen3-omni", voice="alloy", input="Hello there", response_format="wav")
    assert fake.calls[0]["parameters"]["speaker"] == "ethan"


def test_default_format_is_mp3_and_instructions_reach_the_prompt(http, fake):
    fake.script = spoken()
    r = http.post("/v1/audio/speech", json={"input": "Hi", "instructions": "whisper"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert decode_any(r.content, "mp3")[1] == 24000
    assert "whisper" in fake.calls[0]["messages"][0]["content"]
    assert fake.calls[0]["parameters"]["speaker"] == "ethan"  # the server default


def test_pcm_is_streamed_as_produced(http, fake):
    fake.script = spoken(delay_s=0.5)
    start = time.monotonic()
    with http.stream("POST", "/v1/audio/speech", json={"input": "Hi", "response_format": "pcm"}) as r:
        parts = [(time.monotonic() - start, len(b)) for b in r.iter_raw() if b]
    assert sum(n for _, n in parts) == 2 * 29 * 1920
    assert parts[0][0] < 0.4 and parts[-1][0] >= 0.5  # the first chunk came before the second was made


def test_disconnect_cancels(http, fake):
    fake.script = Script(steps=[Step("a", audio=CHUNKS[0])], hang=True)
    with httpx.Client(base_url=str(http.base_url), timeout=10) as other:
        with other.stream("POST", "/v1/audio/speech", json={"input": "Hi", "response_format": "pcm"}) as r:
            chunks = r.iter_raw()
            assert len(next(chunks)) > 0
    assert fake.cancelled.wait(5)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "voice": "albert"}, "voice"),
    ({"input": ""}, "input"),
    ({"input": "x" * 4097}, "input"),
    ({"input": "x", "speed": 1.5}, "speed"),
    ({"input": "x", "response_format": "aac"}, "response_format"),
    ({"input": "x", "stream_format": "sse"}, "stream_format"),
    ({"voice": "ethan"}, "input"),
])  # fmt: skip
def test_bad_requests(http, fake, body, param):
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert fake.calls == []


def test_unknown_model(http):
    assert http.post("/v1/audio/speech", json={"model": "tts-1", "input": "x"}).status_code == 404
