# MropeIndex against transformers' get_rope_index (the oracle) on real processor outputs of the tiny
# checkpoint: audio, images, videos with and without their audio tracks at several lengths and frame rates,
# several items in one prompt; for the thinker and for the talker, which is called without
# use_audio_in_video on prompts whose video and audio rows interleave.
import pytest
import torch

from omnistage.models.hf_compat import talker_audio_config_patch
from omnistage.stages.mrope import MropeIndex
from omnistage.models.processor import prepare_inputs

from .. import oracle
from ..video_clips import make_video, video_data_url


def _audio(seconds, seed=0):
    return {"type": "input_audio", "input_audio": {"data": oracle.wav_base64(seconds, seed=seed), "format": "wav"}}


def _image(seed=0, size=64):
    return {"type": "image_url", "image_url": {"url": oracle.png_data_url(seed, size)}}


def _video(seconds, fps, audio=True, width=96, height=64):
    raw = make_video(seconds=seconds, fps=fps, width=width, height=height, audio=audio)
    return {"type": "video_url", "video_url": {"url": video_data_url(raw)}}


CASES = {
    "text": ([], False),
    "audio": ([_audio(1.0)], False),
    "long audio": ([_audio(9.3, seed=1)], False),
    "image": ([_image()], False),
    "two images": ([_image(1, 96), _image(2, 64)], False),
    "video": ([_video(2.0, 10, audio=False)], False),
    "video, its audio apart": ([_video(2.0, 10)], False),
    "video with its audio": ([_video(2.0, 10)], True),
    "longer video with its audio": ([_video(5.0, 7, width=64, height=96)], True),
    # frames wider than the clip is long: the block after the last frame is audio, and its positions, not the
    # frames' larger width positions, start the end marker's
    "wide video with its audio": ([_video(2.0, 10, width=1280, height=64)], True),
    "audio, image, video with its audio": ([_audio(0.7, seed=2), _image(3), _video(3.0, 12)], True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, processor):
    parts, with_audio = CASES[request.param]
    content = parts + [{"type": "text", "text": "What is this?"}]
    messages = [oracle.SYSTEM, {"role": "user", "content": content}]
    return prepare_inputs(processor, messages, use_audio_in_video=with_audio), with_audio


def _oracle(model, inputs, use_audio_in_video):
    ids = inputs["input_ids"].reshape(1, -1)
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    pos, delta = model.get_rope_index(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                      torch.ones_like(ids), use_audio_in_video, lengths,
                                      inputs.get("video_second_per_grid"))  # fmt: skip
    return pos[:, 0], int(delta.reshape(-1)[0])


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_positions_equal_get_rope_index(hf_model, case, stage):
    inputs, with_audio = case
    model = hf_model.thinker if stage == "thinker" else hf_model.talker
    use_audio_in_video = with_audio and stage == "thinker"  # generate() never passes it to the talker
    with talker_audio_config_patch(hf_model):
        want, want_delta = _oracle(model, inputs, use_audio_in_video)
    n_window = hf_model.config.thinker_config.audio_config.n_window
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    got, delta = MropeIndex(model, n_window)(inputs["input_ids"].reshape(-1), inputs.get("image_grid_thw"),
                                             inputs.get("video_grid_thw"), use_audio_in_video, lengths,
                                             inputs.get("video_second_per_grid"))  # fmt: skip
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert delta == want_delta


def test_a_clip_and_its_frames_interleave_by_time(hf_model, processor):
    # the case the merge replaces get_rope_index's loop for: rows of both kinds, neither block at one end
    inputs = prepare_inputs(processor, [{"role": "user", "content": [_video(4.0, 10)]}], use_audio_in_video=True)
    ids = inputs["input_ids"].reshape(-1)
    mrope = MropeIndex(hf_model.thinker, hf_model.thinker.audio_tower.config.n_window)
    positions, _ = mrope(ids, None, inputs["video_grid_thw"], True, inputs["feature_attention_mask"].sum(-1),
                         inputs["video_second_per_grid"])
    c = hf_model.thinker.config
    kinds = ids[torch.isin(ids, torch.tensor([c.video_token_id, c.audio_token_id]))]
    runs = int((kinds[1:] != kinds[:-1]).sum()) + 1
    assert runs > 4  # frames, audio, frames, ...
    temporal = positions[0, torch.isin(ids, torch.tensor([c.video_token_id, c.audio_token_id]))]
    assert bool((temporal[1:] >= temporal[:-1]).all())
