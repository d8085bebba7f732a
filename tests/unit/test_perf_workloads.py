# perf/workloads.py: deterministic prompts of the right lengths, and request bodies the frontend accepts
# with the forced lengths landing on the right omni_ensemble parameters.
import asyncio

import pytest

from openai_frontend.chat_params import plan_chat
from openai_frontend.schemas import ChatCompletionRequest
from openai_frontend.settings import FrontendSettings
from perf import workloads
from perf.loadgen import level_sizes


def plan_now(*args):
    return asyncio.run(plan_chat(*args))


@pytest.fixture(scope="module")
def tokenizer():
    from omnistage.models.tokenizer import build_tokenizer

    return build_tokenizer()


def test_w1_shape_and_determinism(tokenizer):
    w = workloads.w1(40, tokenizer)
    assert len(tokenizer(workloads.SYSTEM_PROMPT, add_special_tokens=False)["input_ids"]) == 115
    users = [p[1]["content"] for p in w.prompts]
    assert len(set(users)) == 40  # varied sentences
    assert all(18 <= len(tokenizer(u, add_special_tokens=False)["input_ids"]) <= 22 for u in users)
    assert 140 <= min(w.prompt_tokens) and max(w.prompt_tokens) <= 160  # ~150 with the chat template
    assert workloads.w1(40, tokenizer).prompts == w.prompts  # same prompts every run
    assert (w.reply_tokens, w.frames, w.voice, w.temperature) == (18, 46, "ethan", 0.0)


def test_w2_prompt_length(tokenizer):
    w = workloads.w2(2, tokenizer, prompt_tokens=400)
    assert all(abs(n - 400) <= 4 for n in w.prompt_tokens)
    assert (w.reply_tokens, w.frames) == (900, 900)
    assert w.prompts != workloads.w2(2, tokenizer, seed=1, prompt_tokens=400).prompts


@pytest.mark.parametrize("name", ["w1", "w2"])
def test_body_is_accepted_and_forces_lengths(name, tokenizer):
    w = (workloads.w1(3, tokenizer) if name == "w1" else workloads.w2(1, tokenizer, prompt_tokens=100)).with_lengths(
        7, 11
    )
    plan = plan_now(ChatCompletionRequest.model_validate(w.body(2)), FrontendSettings())
    assert plan.stream and plan.include_usage and plan.audio_out and plan.text_out and plan.audio_format == "pcm"
    assert plan.parameters == {
        "modalities": "text,audio",
        "speaker": "ethan",
        "max_tokens": 7,
        "ignore_eos": True,
        "temperature": 0.0,
        "talker_max_tokens": 11,
        "talker_min_tokens": 11,
        "talker_ignore_eos": True,
        "talker_temperature": 0.0,
    }
    # the direct Triton form says the same (floats as strings, as perf_analyzer must send them)
    assert {k: (float(v) if "temperature" in k else v) for k, v in w.omni_parameters().items()} == plan.parameters


def test_params_record_the_workload(tokenizer):
    p = workloads.w1(5, tokenizer).params()
    assert p["name"] == "w1" and p["num_distinct_prompts"] == 5 and p["audio_s_per_request"] == pytest.approx(3.68)
    assert p["request_example"]["sampling_params_list"][1]["max_tokens"] == 46


def test_level_sizes():
    assert level_sizes([1, 16, 32, 64], 10) == [10, 160, 320, 640]
    assert level_sizes([1, 16], 2, min_prompts=4) == [4, 32]
    assert level_sizes([1, 16], 10, fixed=7) == [7, 7]


@pytest.mark.parametrize("name", ["w3", "w4"])
def test_media_workloads_decode_differ_and_are_accepted(name):
    import base64

    from omnistage.models import media

    w = workloads.build(name, 3)
    assert workloads.build(name, 3).prompts == w.prompts  # same media every run
    parts = [p[0]["content"][0] for p in w.prompts]
    assert len({str(p) for p in parts}) == 3  # every prompt its own clip or picture
    for part in parts:
        if name == "w3":
            samples = media.decode_audio(base64.b64decode(part["input_audio"]["data"]), "wav", "clip")
            assert samples.size == 5 * media.SAMPLE_RATE
            voiced = (abs(samples.reshape(-1, 160)).max(axis=1) > 0.05).mean()
            assert 0.4 < voiced < 0.95  # syllables with pauses between them, not a tone or silence
        else:
            _, raw = media.split_data_url(part["image_url"]["url"], "image")
            assert media.decode_image(raw, "image").size == (448, 448)
    plan = plan_now(ChatCompletionRequest.model_validate(w.body(1)), FrontendSettings())
    assert plan.audio_out and plan.parameters["max_tokens"] == 18 and plan.parameters["talker_max_tokens"] == 46


def test_w5_is_a_10s_video_with_its_audio_track_and_asks_for_it(processor):
    from omnistage.models.processor import prepare_inputs

    w = workloads.build("w5", 2)
    assert workloads.build("w5", 2).prompts == w.prompts  # same clips every run
    assert w.prompts[0][0]["content"][0] != w.prompts[1][0]["content"][0]  # every prompt its own clip
    inputs = prepare_inputs(processor, w.prompts[0], use_audio_in_video=True)
    assert inputs["video_grid_thw"][0, 0] * inputs["video_second_per_grid"][0] == 10  # 10 s of sampled frames
    assert 1000 <= inputs["feature_attention_mask"].sum() <= 1010  # its track: 10 s (AAC pads its first frame)
    plan = plan_now(ChatCompletionRequest.model_validate(w.body(1)), FrontendSettings())
    assert plan.audio_out and plan.parameters["use_audio_in_video"] is True
    assert plan.parameters["max_tokens"] == 18 and plan.parameters["talker_max_tokens"] == 46
