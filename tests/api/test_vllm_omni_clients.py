# vLLM-Omni's own request shapes, sent as its clients write them, to `python -m openai_frontend` over a
# Triton that speaks the real gRPC protocol (fake_triton.py): the example client
# (examples/online_serving/qwen3_omni/openai_chat_completion_client_for_multimodal_generation.py: its
# default model name, system prompt and three-stage sampling_params_list) and `vllm bench serve --omni`'s
# streamed body (backend openai-chat-omni), read the way that benchmark reads it.
import base64
import io
import json
import wave

import httpx
import openai
import pytest

from .fake_omni import tone
from .fake_triton import FakeTriton, Reply, infer_response
from .servers import FrontendProcess

pytestmark = pytest.mark.anyio
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
USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "audio_frames": 2}


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def triton():
    async with FakeTriton() as t:
        yield t


@pytest.fixture(scope="module")
def frontend(triton):
    # the style vLLM-Omni's benchmark reads (`modality` on every chunk); the default names
    with FrontendProcess("--triton-url", triton.url, "--response-style", "vllm-omni", "--no-stage-probes") as proc:
        yield proc
    print(proc.output)


@pytest.fixture
def fresh(triton):
    triton.replies, triton.hang_after_replies, triton.model_ready = [], False, True
    triton.received.clear()
    return triton


def spoken() -> list[Reply]:
    return [Reply(infer_response(text="Hi", token_ids=[1], audio=tone(1920))),
            Reply(infer_response(text="!", token_ids=[2], audio=tone(1920, offset=1920), finish_reason="stop",
                                 usage=USAGE, final=True))]  # fmt: skip


async def test_the_example_client_request(frontend, fresh):
    fresh.replies = spoken()
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="EMPTY", max_retries=0, timeout=10)
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


async def test_the_bench_serve_omni_request(frontend, fresh):
    fresh.replies = spoken()
    payload = {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
               "temperature": 0.0, "max_tokens": 2048, "stream": True, "stream_options": {"include_usage": True}}
    text, pcm, prompt_len = "", b"", None
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream("POST", f"{frontend.url}/v1/chat/completions", json=payload,
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


async def test_a_context_overflow_names_both_numbers_and_the_field(frontend, fresh):
    # the stage's 400 crosses Triton with its param and code (core/errors.py's wire form)
    fresh.replies = [Reply(error="[400 param=max_tokens code=context_length_exceeded] max_tokens is too large: "
                                 "16384. This server's context is 4096 tokens and the prompt has 40 (40 + 16384 > 4096)")]
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="EMPTY", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="qwen3-omni", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=16384)  # fmt: skip
    assert (e.value.body["param"], e.value.body["code"]) == ("max_tokens", "context_length_exceeded")
    assert "16384" in e.value.body["message"] and "4096" in e.value.body["message"]
