# The OpenAI frontend over the real pipeline (tiny checkpoint, real tritonserver), with the openai SDK:
# streamed and non-streamed text+audio agree with each other and with omni_ensemble called directly,
# the WAV is valid 24 kHz mono pcm16 of the decoded length, and /health reports ready. Both processes
# write request traces (OMNI_TRACE_DIR), which perf/trace_join.py lines up with the load generator's requests.
import asyncio
import base64
import os

import httpx
import numpy as np
import openai
import pytest

from omnistage.core.request_trace import TRACE_DIR_ENV
from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT
from perf import trace_join, workloads
from perf.loadgen import run_level

from .. import oracle
from ..api.servers import FrontendProcess
from ..api.wav_check import expected_pcm16, parse_wav, pcm16_samples
from .conftest import RepoSpec
from .omni_client import omni

REPLY, FRAMES = 5, 30
STAGES = [{"temperature": 0}, {"temperature": 0, "max_tokens": FRAMES, "repetition_penalty": 1.05}]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint, trace_dir):
    return RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository",
                    env={**os.environ, TRACE_DIR_ENV: str(trace_dir)})  # fmt: skip


@pytest.fixture(scope="module")
def frontend(triton_server, trace_dir):
    with FrontendProcess("--triton-url", triton_server.grpc_url, env={TRACE_DIR_ENV: str(trace_dir)}) as f:
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
    assert [m.id for m in client(frontend).models.list().data] == ["Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni"]


def test_non_streaming_text_and_audio(frontend, direct):
    completion = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, max_tokens=REPLY, temperature=0,
        extra_body={"sampling_params_list": STAGES},
    )  # fmt: skip
    message = completion.choices[0].message
    assert message.content is None and message.audio.transcript == direct.text  # OpenAI's shape
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
        assert delta.content is None  # with audio on, the text is the audio's transcript (OpenAI's shape)
        text += (delta.audio.transcript or "") if delta.audio else ""
        data = getattr(delta.audio, "data", None) if getattr(delta, "audio", None) else None
        if data:
            chunks.append(pcm16_samples(data))
        finish = chunk.choices[0].finish_reason or finish
    assert text == direct.text and finish == "length"
    assert len(chunks) == len(direct.audio)  # one SSE audio event per streamed chunk
    assert np.array_equal(np.concatenate(chunks), expected_pcm16(direct.waveform))


def test_a_later_turn_refers_to_the_spoken_reply(frontend, direct):
    first = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), audio={"voice": "ethan", "format": "wav"},
        max_tokens=REPLY, temperature=0, extra_body={"sampling_params_list": STAGES},
    )  # fmt: skip
    # the reply's id stands for its transcript: the same prompt as sending the text itself
    turns = lambda assistant: [*oracle.messages("text"), assistant, {"role": "user", "content": "Again."}]
    by_id, by_text = (client(frontend).chat.completions.create(
        model="qwen3-omni", messages=turns(assistant), modalities=["text"], max_tokens=REPLY, temperature=0)
        for assistant in ({"role": "assistant", "audio": {"id": first.choices[0].message.audio.id}},
                          {"role": "assistant", "content": direct.text}))  # fmt: skip
    assert by_id.choices[0].message.content == by_text.choices[0].message.content
    assert by_id.usage.prompt_tokens == by_text.usage.prompt_tokens


def test_text_only(frontend, direct):
    completion = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), modalities=["text"], max_tokens=REPLY, temperature=0
    )
    assert completion.choices[0].message.content == direct.text
    assert completion.choices[0].message.audio is None


def test_usage_counts_the_prompt_tokens_taken_from_the_prefix_cache(frontend):
    """A text prompt's blocks are kept on their second sighting (core/prefix_index.py), so its third request
    takes them from the thinker's cache: all of its whole 16-token blocks but the last token's, as OpenAI
    reports them in usage.prompt_tokens_details.cached_tokens, streamed or not."""
    messages = [{"role": "system", "content": "You read the user's message aloud, word for word. " * 3},
                {"role": "user", "content": "The usage test's own sentence, seen by no other test."}]  # fmt: skip
    ask = dict(model="qwen3-omni", messages=messages, modalities=["text"], max_tokens=2, temperature=0)
    usages = [client(frontend).chat.completions.create(**ask).usage for _ in range(3)]
    stream = client(frontend).chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    usages.append([c for c in stream if c.usage is not None][-1].usage)
    prompt = usages[0].prompt_tokens
    assert prompt > 48 and all(u.prompt_tokens == prompt for u in usages)
    whole_blocks = (prompt - 1) // 16 * 16
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 0, whole_blocks, whole_blocks]


# ---- response styles, formats, metrics and bad input over the real pipeline ------------------------------
def test_vllm_omni_style_stream(frontend, direct):
    from ..api.test_response_styles import vllm_omni_stream

    body = {"model": "qwen3-omni", "messages": oracle.messages("text"), "response_style": "vllm-omni",
            "speaker": "Ethan", "max_tokens": REPLY, "temperature": 0, "sampling_params_list": STAGES}  # fmt: skip
    text, audio, events = vllm_omni_stream(frontend.url, body)
    assert text == direct.text and len(audio) == len(direct.audio)
    # each chunk a WAV of its own; together the very samples omni_ensemble streamed
    np.testing.assert_array_equal(np.concatenate([parse_wav(a) for a in audio]), expected_pcm16(direct.waveform))
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_compressed_formats(frontend, direct, fmt):
    from ..api.wav_check import decode_any

    completion = client(frontend).chat.completions.create(
        model="qwen3-omni", messages=oracle.messages("text"), audio={"voice": "ethan", "format": fmt},
        max_tokens=REPLY, temperature=0, extra_body={"sampling_params_list": STAGES},
    )  # fmt: skip
    samples, rate = decode_any(base64.b64decode(completion.choices[0].message.audio.data), fmt)
    frames = completion.usage.completion_tokens_details.audio_tokens
    assert rate == 24000 and frames == direct.usage["audio_frames"]
    if fmt == "flac":  # lossless: the very samples
        np.testing.assert_array_equal(samples.astype(np.int16), expected_pcm16(direct.waveform))
    else:
        assert abs(len(samples) - (frames * 1920 - 555)) <= 2400


def test_metrics_and_bad_input(frontend):
    http = httpx.Client(base_url=frontend.url, timeout=10)
    assert http.post("/v1/chat/completions", json={"messages": oracle.messages("text"), "voice": "alloy"}).status_code == 400
    assert http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode(), "format": "wav"}}]}]})
    assert r.status_code == 400 and "WAV" in r.json()["error"]["message"]  # rejected by omni_ensemble itself
    # named as the frontend names the parts it checks itself (openai_frontend/README.md, Errors)
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages[0].content[0]", "invalid_value")
    assert http.get("/health").status_code == 200
    short = {"messages": oracle.messages("text"), "max_tokens": 2, "sampling_params_list": [{}, {"max_tokens": 4}]}
    assert http.post("/v1/chat/completions", json=short).status_code == 200
    metrics = {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    assert metrics['omni_frontend_requests_total{route="/v1/chat/completions",status="400"}'] == 3
    for name in ("audio_ttfp_seconds", "rtf", "time_to_first_token_seconds", "queue_seconds"):
        assert metrics[f"omni_frontend_{name}_count"] >= 1, name
    assert metrics["omni_frontend_audio_seconds_total"] > 0 and metrics["omni_frontend_requests_in_flight"] == 0


def test_speech_endpoint(frontend):
    frames = 8
    body = {"input": "Hello there.", "voice": "chelsie", "response_format": "wav",
            "sampling_params_list": [{"max_tokens": 3}, {"max_tokens": frames, "min_tokens": frames, "ignore_eos": True}]}  # fmt: skip
    r = httpx.post(f"{frontend.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    samples = parse_wav(r.content)
    assert len(samples) == frames * 1920 - 555 and np.abs(samples).max() > 1000


def test_request_traces_join_the_load_generators_requests(frontend, trace_dir):
    workload = workloads.Workload(name="t", description="test", reply_tokens=3, frames=6, concurrency=(2,),
                                  prompts=[oracle.messages("text")] * 3, prompt_tokens=[20] * 3)  # fmt: skip
    level = asyncio.run(run_level(frontend.url, workload, 2, 3))
    assert level.summary()["completed"] == 3
    requests = [r.to_json() for r in level.records]
    joined = trace_join.hop_means(requests, trace_join.load_traces(trace_dir))
    # every request is found in both traces by the id the client saw, and the stamps of the three processes
    # (one host clock) fall in the order of the request's way: no hop is negative
    assert joined["requests_joined"] == 3, joined
    hops = joined["mean_ms"]
    assert set(hops) == set(trace_join.TEXT_HOPS) | set(trace_join.AUDIO_HOPS), hops
    assert all(ms >= 0 for ms in hops.values()), hops


def test_vllm_omni_example_client_needs_a_context_that_fits_its_max_tokens(frontend):
    # (after test_metrics_and_bad_input, which counts this module's 400s) its thinker max_tokens (16384) exceeds this server's 1024-token context: a 400 naming both, as vLLM's
    with pytest.raises(openai.BadRequestError) as e:
        client(frontend).chat.completions.create(
            model="Qwen/Qwen3-Omni-30B-A3B-Instruct", messages=oracle.messages("text"),
            extra_body={"sampling_params_list": [{"temperature": 0.4, "max_tokens": 16384}, {"max_tokens": 4096}]})
    assert (e.value.body["param"], e.value.body["code"]) == ("max_tokens", "context_length_exceeded")
    assert "16384" in e.value.body["message"] and "1024" in e.value.body["message"]
