# The two response styles and every voice and audio format, through the openai SDK and a vLLM-Omni-style
# SSE client, against uvicorn over the fake backend; the decoded audio is checked, not just its presence.
import base64
import json

import httpx
import numpy as np
import pytest

from openai_frontend.app import create_app
from openai_frontend.settings import FrontendSettings

from .fake_omni import FakeOmniClient, Script, Step, tone
from .servers import ThreadedUvicorn
from .wav_check import decode_any, expected_pcm16

USER = [{"role": "user", "content": "Say hello."}]
CHUNKS = [tone(1920 * 4, offset=0), tone(1920 * 25, offset=1920 * 4), tone(1920 * 3 - 555, offset=1920 * 29)]
FRAMES = 31  # the fake reports len(chunk) // 1920 frames per chunk: 4 + 25 + 2 (its tail is short)
FORMATS = ["wav", "pcm", "flac", "mp3", "opus"]
VOICES = ["chelsie", "ethan", "aiden"]


def spoken() -> Script:
    return Script(steps=[Step("Hello"), Step(", ", audio=CHUNKS[0]), Step("world", audio=CHUNKS[1]), Step("", audio=CHUNKS[2])])


def all_samples() -> np.ndarray:
    return np.concatenate(CHUNKS)


def check_audio(data: bytes, fmt: str, frames: int) -> np.ndarray:
    """Valid file of the format, 24 kHz, as long as `frames` codec frames of 1920 samples (80 ms) say."""
    samples, rate = decode_any(data, fmt)
    assert rate == 24000
    slack = 0 if fmt in ("wav", "pcm", "flac") else 2400  # a lossy codec may pad by up to a frame of its own
    assert abs(len(samples) - len(all_samples())) <= slack, (fmt, len(samples))
    assert abs(len(samples) - frames * 1920) <= 1920 + slack  # duration consistent with the frames
    if fmt in ("wav", "pcm", "flac"):  # lossless: the very samples
        np.testing.assert_array_equal(samples.astype(np.int16), expected_pcm16(all_samples()))
    return samples


@pytest.mark.parametrize("voice", VOICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_style_non_stream_every_voice_and_format(openai_client, fake, voice, fmt):
    fake.script = spoken()
    r = openai_client.chat.completions.create(
        model="qwen3-omni", messages=USER, modalities=["text", "audio"], audio={"voice": voice.title(), "format": fmt}
    )
    frames = r.usage.completion_tokens_details.audio_tokens
    assert frames == FRAMES
    check_audio(base64.b64decode(r.choices[0].message.audio.data), fmt, frames)
    assert fake.calls[0]["parameters"]["speaker"] == voice


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_style_stream_is_pcm16_for_every_format(openai_client, fake, fmt):
    fake.script = spoken()
    stream = openai_client.chat.completions.create(
        model="qwen3-omni", messages=USER, audio={"voice": "ethan", "format": fmt}, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    pcm = b"".join(base64.b64decode(c.choices[0].delta.audio.data) for c in chunks
                   if c.choices and c.choices[0].delta.audio and c.choices[0].delta.audio.data)  # fmt: skip
    check_audio(pcm, "pcm", FRAMES)
    assert chunks[-1].usage.completion_tokens_details.audio_tokens == FRAMES and chunks[-1].usage.prompt_tokens == 7


# ---- vLLM-Omni style -----------------------------------------------------------------------------------
def vllm_omni_stream(url: str, body: dict, headers: dict | None = None) -> tuple[str, list[bytes], list[dict]]:
    """What vLLM-Omni's benchmark client does: read SSE lines, route each chunk by its `modality`."""
    text, audio, events = "", [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                      timeout=10) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            events.append(event)
            if not event["choices"]:
                continue
            content = event["choices"][0]["delta"].get("content")
            if event.get("modality") == "audio" and content:
                audio.append(base64.b64decode(content))
            elif event.get("modality") == "text" and content:
                text += content
    return text, audio, events


@pytest.mark.parametrize("fmt", ["wav", "flac", "opus"])
def test_vllm_omni_style_stream_per_request(server, fake, fmt):
    fake.script = spoken()
    body = {"messages": USER, "response_style": "vllm-omni", "audio": {"format": fmt}, "speaker": "chelsie",
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, audio, events = vllm_omni_stream(server.url, body)
    assert text == "Hello, world" and len(audio) == 3
    assert all(e.get("modality") in ("text", "audio") for e in events if e["choices"])
    # every audio chunk is a whole file of its own
    decoded = [decode_any(a, fmt) for a in audio]
    assert all(rate == 24000 for _, rate in decoded)
    if fmt == "wav":
        np.testing.assert_array_equal(np.concatenate([s for s, _ in decoded]).astype(np.int16),
                                      expected_pcm16(all_samples()))  # fmt: skip
    if fmt != "opus":  # lossless chunk files hold exactly their chunk's samples
        assert [len(s) for s, _ in decoded] == [len(c) for c in CHUNKS]
    assert events[-1]["usage"]["completion_tokens_details"]["audio_tokens"] == FRAMES
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"


def test_vllm_omni_style_audio_only_sends_no_empty_audio(server, fake):
    fake.script = spoken()
    text, audio, events = vllm_omni_stream(server.url, {"messages": USER, "response_style": "vllm-omni",
                                                        "modalities": ["audio"]})  # fmt: skip
    assert text == "" and len(audio) == 3 and all(a[:4] == b"RIFF" for a in audio)
    audio_events = [e for e in events if e.get("modality") == "audio"]
    assert len(audio_events) == 3 and all(e["choices"][0]["delta"]["content"] for e in audio_events)


def test_vllm_omni_style_non_stream(openai_client, fake):
    fake.script = spoken()
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, extra_body={"response_style": "vllm-omni"})
    assert len(r.choices) == 2 and r.choices[0].message.content == "Hello, world" and r.choices[0].message.audio is None
    assert r.choices[1].index == 1 and r.choices[1].message.content is None
    check_audio(base64.b64decode(r.choices[1].message.audio.data), "wav", FRAMES)


@pytest.fixture(scope="module")
def vllm_default_server():
    """A second app whose --response-style is vllm-omni."""
    backend = FakeOmniClient()
    backend.script = spoken()
    with ThreadedUvicorn(create_app(backend, FrontendSettings(response_style="vllm-omni"))) as srv:
        yield srv


def test_server_default_style_and_per_request_override(vllm_default_server):
    text, audio, _ = vllm_omni_stream(vllm_default_server.url, {"messages": USER})
    assert text == "Hello, world" and len(audio) == 3
    r = httpx.post(f"{vllm_default_server.url}/v1/chat/completions", timeout=10,
                   json={"messages": USER, "response_style": "openai"}).json()  # fmt: skip
    assert len(r["choices"]) == 1 and r["choices"][0]["message"]["audio"]["transcript"] == "Hello, world"
