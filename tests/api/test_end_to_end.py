# `python -m openai_frontend` as a subprocess over a fake Triton that speaks the real gRPC protocol:
# the whole path openai SDK -> HTTP -> frontend -> tritonclient.grpc.aio -> Triton, cancellation included.
import asyncio
import base64
import io
import json
import socket
import time
import wave

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


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout():
    with FrontendProcess("--triton-url", f"127.0.0.1:{closed_port()}", "--no-stage-probes",
                         "--keep-alive-timeout", "1") as proc:  # fmt: skip
        with socket.create_connection(("127.0.0.1", proc.port), timeout=4) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            head = s.recv(65536)
            answered = time.monotonic()
            assert head.startswith(b"HTTP/1.1 200"), head[:100]
            while s.recv(65536):  # the rest of the body, then the server's close (uvicorn's default: 5 s)
                pass
            assert 0.8 < time.monotonic() - answered < 3


async def test_a_realtime_event_over_the_limit_closes_the_session(frontend):
    """The transport bounds one client event (1009) before buffering it; an event just under it is read and
    answered like any other, and its session lives on."""
    import websockets

    from openai_frontend.realtime.events import MAX_EVENT_BYTES

    url = f"ws://127.0.0.1:{frontend.port}/v1/realtime"
    async with websockets.connect(url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        head = '{"type": "no.such.event", "event_id": "big", "pad": "'
        await ws.send(head + "x" * (MAX_EVENT_BYTES - len(head) - 2) + '"}')
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert error["type"] == "error" and error["error"]["event_id"] == "big", error
        await ws.send('{"type": "session.update", "session": {"type": "realtime"}}')
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "session.updated"
        await ws.send("x" * (MAX_EVENT_BYTES + 1))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1009


# ---- vLLM-Omni's own request shapes, as its clients write them ---------------------------------------------
# The example client (examples/online_serving/qwen3_omni/openai_chat_completion_client_for_multimodal_generation.py
# in vllm-project/vllm-omni: its default model name, system prompt and three-stage sampling_params_list) and
# `vllm bench serve --omni`'s streamed body (backend openai-chat-omni), read the way that benchmark reads it.
SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
          "auditory and visual inputs, as well as generating text and speech.")
SAMPLING_PARAMS_LIST = [
    {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "repetition_penalty": 1.05,
     "stop_token_ids": [151645], "seed": 42},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
     "repetition_penalty": 1.05, "stop_token_ids": [2150]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096 * 16, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
]  # fmt: skip
VLLM_USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "audio_frames": 2}


@pytest.fixture(scope="module")
def vllm_frontend(triton):
    # the style vLLM-Omni's benchmark reads (`modality` on every chunk); the default names
    with FrontendProcess("--triton-url", triton.url, "--response-style", "vllm-omni", "--no-stage-probes") as proc:
        yield proc
    print(proc.output)


@pytest.fixture
def fresh(triton):
    triton.replies, triton.hang_after_replies, triton.model_ready = [], False, True
    triton.received.clear()
    return triton


def spoken_vllm() -> list[Reply]:
    return [Reply(infer_response(text="Hi", token_ids=[1], audio=tone(1920))),
            Reply(infer_response(text="!", token_ids=[2], audio=tone(1920, offset=1920), finish_reason="stop",
                                 usage=VLLM_USAGE, final=True))]  # fmt: skip


async def test_vllm_omni_example_client_request(vllm_frontend, fresh):
    fresh.replies = spoken_vllm()
    client = openai.AsyncOpenAI(base_url=f"{vllm_frontend.url}/v1", api_key="EMPTY", max_retries=0, timeout=10)
    completion = await client.chat.completions.create(
        messages=[{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                  {"role": "user", "content": [{"type": "text", "text": "Explain it in 15 words."}]}],
        model="Qwen/Qwen3-Omni-30B-A3B-Instruct",
        extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST},
    )
    # what the example does with the reply: a WAV file per audio choice, the text of the others
    texts = [c.message.content for c in completion.choices if not c.message.audio and c.message.content]
    wavs = [base64.b64decode(c.message.audio.data) for c in completion.choices if c.message.audio]
    assert texts == ["Hi!"] and len(wavs) == 1
    with wave.open(io.BytesIO(wavs[0])) as w:
        assert (w.getframerate(), w.getnframes()) == (24000, 3840)
    params = fresh.received[0].parameters
    assert (params["max_tokens"], params["talker_max_tokens"], params["stop_token_ids"]) == (16384, 4096, "[151645]")
    assert completion.model == "Qwen/Qwen3-Omni-30B-A3B-Instruct"


async def test_vllm_omni_bench_serve_request(vllm_frontend, fresh):
    fresh.replies = spoken_vllm()
    payload = {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
               "temperature": 0.0, "max_tokens": 2048, "stream": True, "stream_options": {"include_usage": True}}
    text, pcm, prompt_len = "", b"", None
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream("POST", f"{vllm_frontend.url}/v1/chat/completions", json=payload,
                               headers={"Authorization": "Bearer None"}) as r:  # fmt: skip
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line.removeprefix("data: "))
                if choices := data.get("choices"):
                    content = choices[0]["delta"].get("content")
                    if data["modality"] == "text":
                        text += content or ""
                    elif data["modality"] == "audio" and content:
                        with wave.open(io.BytesIO(base64.b64decode(content))) as w:
                            pcm += w.readframes(w.getnframes())
                if usage := data.get("usage"):
                    prompt_len = usage["prompt_tokens"]
    assert (text, len(pcm) // 2, prompt_len) == ("Hi!", 3840, 40)
    assert fresh.received[0].parameters["max_tokens"] == 2048


async def test_a_context_overflow_names_both_numbers_and_the_field(vllm_frontend, fresh):
    # the stage's 400 crosses Triton with its param and code (core/errors.py's wire form)
    fresh.replies = [Reply(error="[400 param=max_tokens code=context_length_exceeded] max_tokens is too large: "
                                 "16384. This server's context is 4096 tokens and the prompt has 40 (40 + 16384 > 4096)")]
    client = openai.AsyncOpenAI(base_url=f"{vllm_frontend.url}/v1", api_key="EMPTY", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="qwen3-omni", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=16384)  # fmt: skip
    assert (e.value.body["param"], e.value.body["code"]) == ("max_tokens", "context_length_exceeded")
    assert "16384" in e.value.body["message"] and "4096" in e.value.body["message"]
