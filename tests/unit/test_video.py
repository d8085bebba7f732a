# Video parts: limits checked from the container's headers before any frame is decoded, frames sampled and
# sized by Qwen's rules, patches laid out as transformers' Qwen2-VL processors lay them, and the thinker and
# talker runners equal to generate() on the tiny checkpoint for a short synthetic clip, with and without its
# audio track (use_audio_in_video interleaves the track's rows with the frames' rows).
import numpy as np
import pytest
import torch

from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams
from omnistage.models import media, video
from omnistage.models.processor import prepare_inputs
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from ..video_clips import make_video, video_data_url
from .media_limits import limits  # noqa: F401  (fixture)
from .test_stage_oracle import FRAMES, REPLY, run_talker, run_thinker, running

VIDEO_PAD, AUDIO_PAD = 151656, 151675


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video(seconds=2.0, fps=10, width=96, height=64, audio=True)


def _messages(raw: bytes, text="What happens here?"):
    return [oracle.SYSTEM, {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_data_url(raw)}},
                                                         {"type": "text", "text": text}]}]  # fmt: skip


def test_frames_are_sampled_and_sized_by_qwens_rules(clip):
    plan = video.plan(clip, "v", with_audio=True)
    # 20 frames at 10 fps: 2 s x 2 fps = 4 frames (also the minimum), evenly spaced, ends included
    assert plan.indices == (0, 6, 13, 19) and plan.sample_fps == pytest.approx(2.0)
    # 96x64 holds too few 32x32 patches (min 128): scaled up keeping the aspect, to multiples of 32
    assert plan.size == (320, 448) and 320 * 448 >= video.MIN_FRAME_PIXELS
    assert video.sample_count(250, 25.0) == 20  # 10 s at 25 fps
    assert video.sample_count(7, 30.0) == 4  # short clips take at least 4 frames
    assert video.sample_count(30 * 60 * 30, 30.0) == 768  # 30 min: capped at 768
    frames = video.decode_frames(clip, plan, "v")
    assert frames.shape == (4, 320, 448, 3) and frames.dtype == np.uint8
    assert not np.array_equal(frames[0], frames[1])  # distinct frames, not one repeated


def test_video_patches_have_the_image_processors_layout(processor):
    # a still video of two identical frames is what the image processor makes of that frame
    rng = np.random.default_rng(1)
    frame = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    out = processor.video_processor([np.stack([frame, frame])])
    from PIL import Image

    want = processor.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")
    assert out["video_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(out["pixel_values_videos"], want["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw, message", [
    ({"max_video_seconds": 1.5}, "video of 2 s is over the limit of 1.5 s"),
    ({"max_video_frame_pixels": 96 * 63}, "96x64 pixels are over the limit"),
    ({"max_video_frames": 2}, "4 frames, over the limit of 2"),
    ({"max_video_bytes": 1000}, "bytes is over the limit of 1000"),
    ({"max_audio_seconds": 1.0}, "audio of 2 s is over the limit of 1 s"),
])  # fmt: skip
def test_limits_refuse_before_any_frame_is_decoded(processor, clip, limits, monkeypatch, kw, message):
    limits(**kw)
    monkeypatch.setattr(video, "decode_frames", lambda *a: pytest.fail("decoded a refused video"))
    monkeypatch.setattr(video, "decode_audio", lambda *a: pytest.fail("decoded a refused video's audio"))
    with pytest.raises(BadRequestError, match=message):
        prepare_inputs(processor, _messages(clip), use_audio_in_video=True)


def test_audio_in_video_needs_an_audio_track_and_one_video_per_request(processor, clip):
    silent = make_video(seconds=2.0, audio=False)
    with pytest.raises(BadRequestError, match="needs a video with an audio track"):
        prepare_inputs(processor, _messages(silent), use_audio_in_video=True)
    assert prepare_inputs(processor, _messages(silent))["video_grid_thw"].tolist() == [[2, 20, 28]]
    two = _messages(clip)
    two[1]["content"].append(two[1]["content"][0])
    with pytest.raises(BadRequestError, match="one video per request"):
        prepare_inputs(processor, two)


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "frames+audio"])
def test_thinker_and_talker_match_generate_on_a_video(with_audio, clip, hf_model, processor):
    inputs = prepare_inputs(processor, _messages(clip), use_audio_in_video=with_audio)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(VIDEO_PAD) == 2 * 20 * 28 // 4  # grid t 2 x h 20 x w 28 patches, merged 2x2
    assert (ids.count(AUDIO_PAD) > 0) == with_audio
    if with_audio:  # frames' and track's rows interleave by time: audio rows sit between the two grids' rows
        first, last = ids.index(VIDEO_PAD), len(ids) - 1 - ids[::-1].index(VIDEO_PAD)
        assert AUDIO_PAD in ids[first:last]
    hf_inputs = dict(inputs, use_audio_in_video=with_audio)
    want_text, want_codes, _ = oracle.generate(hf_model, hf_inputs, REPLY, FRAMES)

    kw = dict(max_slots=2, max_seq_len=1024, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    prompt = ThinkerPrompt(inputs["input_ids"][0], input_features=inputs.get("input_features"),
                           feature_attention_mask=inputs.get("feature_attention_mask"), export_talker=True,
                           pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"],
                           video_second_per_grid=inputs["video_second_per_grid"], use_audio_in_video=with_audio)  # fmt: skip
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY), prompt, slot=1))
    assert out.token_ids == want_text
    talker = TalkerRunner(hf_model.talker, hf_model.config, **kw)
    lengths = inputs["feature_attention_mask"].sum(-1) if with_audio else None
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, None, lengths,
                      inputs["video_grid_thw"], inputs["video_second_per_grid"])  # fmt: skip
    codes, _ = run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 0))
    assert torch.equal(codes, want_codes)
