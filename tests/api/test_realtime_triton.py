# /v1/realtime over the real pipeline (tiny checkpoint, real tritonserver, `python -m openai_frontend`),
# driven by the openai SDK's realtime client with synthesized speech: a two-turn voice conversation,
# barge-in freeing every stage, manual commits, and the prefix cache on the second turn.
import asyncio
import base64
import math
import re
import time
import urllib.request

import numpy as np
import pytest

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.checkpoint import load_config
from omnistage.models.processor import prepare_inputs

from ..triton.conftest import Launcher, RepoSpec
from .realtime_helpers import KEY, sdk, stream_audio, until, utterance
from .servers import FrontendProcess

pytestmark = pytest.mark.anyio
FRAMES = 20
# greedy and short: the tiny checkpoint's answers are random tokens, so lengths are forced
SHORT = [{"temperature": 0, "max_tokens": 4, "min_tokens": 4, "ignore_eos": True},
         {"temperature": 0, "max_tokens": FRAMES, "min_tokens": FRAMES, "ignore_eos": True}]  # fmt: skip
ENDLESS = [{"temperature": 0, "max_tokens": 900, "ignore_eos": True},
           {"temperature": 0, "max_tokens": 500, "ignore_eos": True}]  # fmt: skip
TURN_S = 240  # one turn on 2 shared CPU cores


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def triton(tiny_checkpoint, tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("triton"))
    try:
        # a generous load timeout: 2 CPU cores shared with other work load four Python models slowly
        yield launcher(RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository",
                                ready_timeout_s=600))
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def frontend(triton):
    with FrontendProcess("--triton-url", triton.grpc_url, "--api-key", KEY) as f:
        yield f
    print(f.output)


def metrics(triton) -> dict[str, float]:
    with urllib.request.urlopen(triton.metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, value in re.findall(r"^(omni_\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def held(m: dict[str, float]) -> dict[str, float]:
    """What running requests hold: every stage's slots, code2wav's queue, omni_ensemble's requests."""
    names = [n for n in m if n.endswith("_slots_in_use")] + ["omni_code2wav_queue_depth", "omni_requests_in_flight"]
    return {n: m[n] for n in names if n in m}


async def voice_turn(conn, seconds: float, f0: float) -> tuple[list, object]:
    await stream_audio(conn, utterance(seconds, f0=f0))
    seen: list = []
    done = await until(conn, "response.done", seen, timeout=TURN_S)
    return seen, done


async def configure(conn, stages, **session):
    await until(conn, "session.created")
    await conn.session.update(session={"type": "realtime", "sampling_params_list": stages, **session})
    await until(conn, "session.updated")


async def test_two_turn_voice_conversation(frontend, triton):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, SHORT)
        turns = [await voice_turn(conn, 1.0, 140.0), await voice_turn(conn, 0.8, 190.0)]
    for seen, done in turns:
        kinds = [e.type for e in seen]
        assert "input_audio_buffer.speech_stopped" in kinds and "input_audio_buffer.committed" in kinds
        assert done.response.status == "completed", done.response.status_details
        transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
        audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
        usage = done.response.usage
        assert usage.output_token_details.text_tokens == 4 and usage.output_token_details.audio_tokens == FRAMES
        assert len(audio) // 2 == FRAMES * 1920 - 555  # 24 kHz pcm16, the whole decoded utterance
        assert transcript and done.response.output[0].content[0].transcript == transcript
    # the second prompt is the first one, its answer and the new audio
    first, second = turns[0][1].response.usage, turns[1][1].response.usage
    assert second.input_tokens > first.input_tokens + first.output_token_details.text_tokens


async def test_barge_in_frees_every_stage_within_a_second(frontend, triton):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, ENDLESS)
        await stream_audio(conn, utterance(1.0))
        seen: list = []
        await until(conn, "response.output_audio.delta", seen, timeout=TURN_S)
        deadline = time.monotonic() + 3.0  # the gauges are published every 0.25 s: wait for the answer's slots
        while not any(held(metrics(triton)).values()):
            assert time.monotonic() < deadline, "no stage holds the endless answer while it plays"
            await asyncio.sleep(0.05)
        await stream_audio(conn, utterance(0.6, silence_s=0.0, f0=190.0))  # the user talks over the answer
        await until(conn, "input_audio_buffer.speech_started", seen)
        started = time.monotonic()
        done = await until(conn, "response.done", seen)
        assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
        # the gauges are published every 0.25 s: the first sample after the frees shows zero everywhere
        while any((now := held(metrics(triton))).values()):
            assert time.monotonic() - started < 1.0, f"still held 1 s after speech started: {now}"
            await asyncio.sleep(0.05)
    # the cancelled response's usage: its prompt, and the text and audio that reached the client
    usage = done.response.usage
    heard = sum(len(base64.b64decode(e.delta)) for e in seen if e.type == "response.output_audio.delta") // 2
    spoken = sum(1 for e in seen if e.type == "response.output_audio_transcript.delta")
    assert usage.input_tokens > usage.input_token_details.audio_tokens > 0
    assert usage.output_token_details.audio_tokens == math.ceil(heard / 1920) > 0  # 1920 samples a frame
    assert usage.output_token_details.text_tokens >= spoken > 0


async def test_manual_commit_text_reply(frontend):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, SHORT, audio={"input": {"turn_detection": None}}, output_modalities=["text"])
        await stream_audio(conn, utterance(1.0))
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
        await conn.response.create()
        seen: list = []
        done = await until(conn, "response.done", seen, timeout=TURN_S)
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert done.response.status == "completed" and done.response.output[0].content[0].text == text
    assert not any(e.type == "response.output_audio.delta" for e in seen)
    assert done.response.usage.output_token_details.text_tokens == 4


async def test_second_turn_prefill_hits_the_prefix_cache(frontend, triton):
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, SHORT, output_modalities=["text"])
        _, first = await voice_turn(conn, 1.0, 140.0)
        await asyncio.sleep(0.5)  # one metrics period
        before = metrics(triton).get("omni_thinker_prefix_cache_hit_tokens_total", 0.0)
        _, second = await voice_turn(conn, 0.8, 190.0)
    await asyncio.sleep(0.5)
    hit = metrics(triton).get("omni_thinker_prefix_cache_hit_tokens_total", 0.0) - before
    assert first.response.status == second.response.status == "completed"
    # turn 1's prompt is not recomputed: its whole 16-token blocks come from the cache
    assert hit >= (first.response.usage.input_tokens - 1) // 16 * 16 > 0


async def test_usage_counts_the_prompt_tokens_taken_from_the_prefix_cache(frontend):
    """Text turns: a text prompt's blocks are kept on their second sighting (core/prefix_index.py), so turn 3
    takes the conversation's first turns from the thinker's cache, and its usage says how many tokens (whole
    16-token blocks), as OpenAI's `input_token_details.cached_tokens` does."""
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, SHORT, output_modalities=["text"],
                        instructions="You answer the usage test, and only the usage test, in a few words. " * 3)
        usages = []
        for text in ("What is the first thing to say?", "And the second?", "And the third?"):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": text}]})  # fmt: skip
            await conn.response.create()
            usages.append((await until(conn, "response.done", timeout=TURN_S)).response.usage)
    cached = [u.input_token_details.cached_tokens for u in usages]
    assert cached[:2] == [0, 0] and cached[2] > 48 and cached[2] % 16 == 0, cached
    assert cached[2] < usages[2].input_tokens and usages[2].input_token_details.cached_tokens_details.text_tokens == cached[2]


def audio_prompt_tokens(processor, tiny_checkpoint, samples_16k: int) -> int:
    """The audio placeholder tokens the processor gives a clip of that many 16 kHz samples."""
    pcm = base64.b64encode(np.zeros(samples_16k, "<i2").tobytes()).decode()
    msgs = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": pcm, "format": "pcm"}}]}]
    ids = prepare_inputs(processor, msgs)["input_ids"]
    return int((ids == load_config(str(tiny_checkpoint)).thinker_config.audio_token_id).sum())


async def test_usage_counts_audio_prompt_tokens_as_audio(frontend, processor, tiny_checkpoint):
    """Manual turns of 2 s of audio each (32,000 samples at the model's 16 kHz): input_token_details counts
    each clip's placeholders as audio tokens, the rest as text; the second turn takes the first turn's audio
    from the prefix cache and says so in cached_tokens_details."""
    clip = audio_prompt_tokens(processor, tiny_checkpoint, 32000)
    async with sdk(frontend.url).realtime.connect(model="qwen3-omni") as conn:
        await configure(conn, SHORT, audio={"input": {"turn_detection": None}}, output_modalities=["text"])
        usages = []
        for f0 in (140.0, 190.0):
            await stream_audio(conn, utterance(1.0, f0=f0))  # 0.2 s + 1.0 s + 0.8 s at 24 kHz
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            usages.append((await until(conn, "response.done", timeout=TURN_S)).response.usage)
    for turn, usage in enumerate(usages, 1):
        details = usage.input_token_details
        assert (details.audio_tokens, details.image_tokens) == (turn * clip, 0)
        assert details.text_tokens == usage.input_tokens - turn * clip > 0
        cached = details.cached_tokens_details
        assert cached.text_tokens + cached.audio_tokens + cached.image_tokens == details.cached_tokens
    assert 0 < usages[1].input_token_details.cached_tokens_details.audio_tokens <= clip
