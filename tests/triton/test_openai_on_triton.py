# The OpenAI frontend over the real pipeline (tiny checkpoint, real tritonserver), with the openai SDK:
# streamed and non-streamed text+audio agree with each other and with omni_ensemble called directly,
# the WAV is valid 24 kHz mono pcm16 of the decoded length, and /health reports ready.
import base64

import httpx
import numpy as np
import openai
import pytest

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from .. import oracle
from ..api.servers import FrontendProcess
from ..api.wav_check import expected_pcm16, parse_wav, pcm16_samples
from .conftest import RepoSpec
from .omni_client import omni

REPLY, FRAMES = 5, 30
STAGES = [{"temperature": 0}, {"temperature": 0, "max_tokens": FRAMES, "repetition_penalty": 1.05}]


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    return RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository")


@pytest.fixture(scope="module")
def frontend(triton_server):
    with FrontendProcess("--triton-url", triton_server.grpc_url) as f:
        yield f


@pytest.fixture(scope="module")
def direct(triton_server):
    params = {"temperature": "0", "talker_temperature": "0", "talker_repetition_penalty": "1.05",
              "max_tokens": REPLY, "talker_max_tokens": FRAMES}  # fmt: skip
    r = omni(triton_server.grpc_url, oracle.messages("text"), params)
    assert r.error is None, r.error
    return r


def client(frontend):
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused")


def test_health_and_models(frontend):
    assert httpx.get(f"{frontend.url}/health", timeout=10).status_code == 200
    assert [m.id for m in client(frontend).models.list().data] == ["qwen3-omni"]


def test_non_streaming_text_and_audio(frontend, direct):
    completion = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, max_tokens=REPLY, temperature=0,
        extra_body={"sampling_params_list": STAGES},
    )  # fmt: skip
    message = completion.choices[0].message
    assert message.content == direct.text and message.audio.transcript == direct.text
    samples = parse_wav(base64.b64decode(message.audio.data))
    assert len(samples) == len(direct.waveform) == direct.usage["audio_frames"] * 1920 - 555
    assert np.array_equal(samples, expected_pcm16(direct.waveform))
    assert np.abs(samples).max() > 1000  # audible, not silence
    assert completion.choices[0].finish_reason == "length"


def test_streaming_text_and_audio(frontend, direct):
    stream = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, max_tokens=REPLY, temperature=0, stream=True,
        extra_body={"sampling_params_list": STAGES},
    )  # fmt: skip
    text, chunks, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        text += delta.content or ""
        data = getattr(delta.audio, "data", None) if getattr(delta, "audio", None) else None
        if data:
            chunks.append(pcm16_samples(data))
        finish = chunk.choices[0].finish_reason or finish
    assert text == direct.text and finish == "length"
    assert len(chunks) == len(direct.audio)  # one SSE audio event per streamed chunk
    assert np.array_equal(np.concatenate(chunks), expected_pcm16(direct.waveform))


def test_text_only(frontend, direct):
    completion = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), modalities=["text"], max_tokens=REPLY, temperature=0
    )
    assert completion.choices[0].message.content == direct.text
    assert completion.choices[0].message.audio is None
