# `python -m openai_frontend` as a subprocess over a fake Triton that speaks the real gRPC protocol:
# the whole path openai SDK -> HTTP -> frontend -> tritonclient.grpc.aio -> Triton, cancellation included.
import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from .fake_omni import tone
from .fake_triton import FakeTriton, Reply, closed_port, infer_response
from .servers import FrontendProcess
from .wav_check import expected_pcm16, parse_wav, pcm16_samples

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": [{"type": "text", "text": "Read this."},
                                     {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]
USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "audio_frames": 3}


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # module scope: one event loop for the module, shared with the fake Triton below


@pytest.fixture(scope="module")
async def triton():
    async with FakeTriton() as t:
        yield t


@pytest.fixture(scope="module")
def frontend(triton):
    proc = FrontendProcess("--triton-url", triton.url, "--default-voice", "aiden",
                           "--no-stage-probes")  # the fake Triton has no repository index to probe
    with proc:
        yield proc
    print(proc.output)  # shown by pytest when a test of this module failed


@pytest.fixture
def client(frontend, triton):
    triton.replies, triton.hang_after_replies, triton.model_ready = [], False, True
    triton.received.clear()
    triton.cancelled.clear()
    return openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=10)


def spoken() -> list[Reply]:
    return [
        Reply(infer_response(text="Hi", token_ids=[1])),
        Reply(infer_response(text="!", token_ids=[2], audio=tone(1920))),
        Reply(infer_response(audio=tone(3840, offset=1920))),
        Reply(infer_response(audio=tone(1000, offset=5760), finish_reason="stop", usage=USAGE, final=True)),
    ]


async def test_health(client, frontend, triton):
    async with httpx.AsyncClient(base_url=frontend.url) as http:
        assert (await http.get("/health")).status_code == 200
        triton.model_ready = False
        assert (await http.get("/health")).status_code == 503


async def test_non_stream_wav(client, triton):
    triton.replies = spoken()
    r = await client.chat.completions.create(model="qwen3-omni", messages=USER, max_tokens=32)
    msg = r.choices[0].message
    assert msg.content is None and msg.audio.transcript == "Hi!"
    samples = parse_wav(base64.b64decode(msg.audio.data))
    np.testing.assert_array_equal(samples, expected_pcm16(tone(6760)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.completion_tokens_details.audio_tokens) == (12, 2, 3)
    (req,) = triton.received
    assert req.messages == USER and req.request_id == r.id
    assert req.parameters == {"modalities": "text,audio", "speaker": "aiden", "max_tokens": 32,
                              "triton_enable_empty_final_response": True}


async def test_stream(client, triton):
    triton.replies = spoken()
    stream = await client.chat.completions.create(
        model="qwen3-omni", messages=USER, stream=True, stream_options={"include_usage": True},
        audio={"voice": "chelsie", "format": "wav"}, extra_body={"sampling_params_list": [None, {"max_tokens": 300}]},
    )
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.audio.transcript or "" for d in deltas if d.audio) == "Hi!"
    pcm = np.concatenate([pcm16_samples(d.audio.data) for d in deltas if d.audio and d.audio.data])
    np.testing.assert_array_equal(pcm, expected_pcm16(tone(6760)))
    assert chunks[-1].usage.total_tokens == 14
    assert triton.received[0].parameters["talker_max_tokens"] == 300
    assert triton.received[0].parameters["speaker"] == "chelsie"


async def test_bad_request_from_triton(client, triton):
    triton.replies = [Reply(error="[400] input_audio could not be decoded")]
    with pytest.raises(openai.BadRequestError, match="input_audio could not be decoded"):
        await client.chat.completions.create(model="qwen3-omni", messages=USER, stream=True)


async def test_disconnect_cancels_the_triton_stream(client, triton):
    triton.replies, triton.hang_after_replies = spoken()[:2], True
    stream = await client.chat.completions.create(model="qwen3-omni", messages=USER, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.audio is not None:
            break
    assert not triton.cancelled.is_set()
    await stream.close()
    await asyncio.wait_for(triton.cancelled.wait(), 5)


async def test_triton_down():
    with FrontendProcess("--triton-url", f"127.0.0.1:{closed_port()}", "--no-stage-probes") as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            assert (await http.get("/health")).status_code == 503
            r = await http.post("/v1/chat/completions", json={"messages": USER})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
