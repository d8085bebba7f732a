# Video parts: limits checked from the container's headers before any frame is decoded, frames sampled and
# sized by Qwen's rules, patches laid out as transformers' Qwen2-VL processors lay them, and the thinker and
# talker runners equal to generate() on the tiny checkpoint for a short synthetic clip, with and without its
# audio track (use_audio_in_video interleaves the track's rows with the frames' rows).
import io

import numpy as np
import pytest
import torch

from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams
from omnistage.models import media, video
from omnistage.models.pixels import scale_pixels
from omnistage.models.processor import load_pixel_table, prepare_inputs
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from ..video_clips import make_video, video_data_url
from .media_limits import limits  # noqa: F401  (fixture)
from .test_stage_oracle import FRAMES, REPLY, run_talker, run_thinker, running, slot_kv

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


def test_frames_are_resized_as_one_clip_by_torchvisions_kernel():
    # qwen-omni-utils resizes all of a clip's uint8 frames in one call of torchvision's resize (bicubic,
    # antialiased: torch's interpolate); decode_frames resizes them in groups as it decodes, to the same pixels,
    # going down (antialiasing matters) as well as up
    import av

    for width, height in ((1280, 720), (96, 64)):
        clip = make_video(seconds=6.0, fps=4, width=width, height=height, audio=False)
        plan = video.plan(clip, "v", with_audio=False)
        assert len(plan.indices) > video.RESIZE_GROUP  # more than one group
        with av.open(io.BytesIO(clip)) as container:
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        clip_frames = torch.from_numpy(np.stack([decoded[i] for i in plan.indices])).permute(0, 3, 1, 2)
        want = torch.nn.functional.interpolate(clip_frames, size=plan.size, mode="bicubic", antialias=True)
        got = video.decode_frames(clip, plan, "v")
        assert (plan.size[0] < height) == (width == 1280)
        np.testing.assert_array_equal(got, want.permute(0, 2, 3, 1).numpy())


def test_video_patches_have_the_image_processors_layout(processor):
    # a still video of two identical frames is what transformers' image processor makes of that frame, once
    # the thinker scales its bytes
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(1)
    frame = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    out = processor.video_processor([np.stack([frame, frame])])
    assert out["pixel_values_videos"].dtype == torch.uint8
    ip = processor.image_processor
    hf = Qwen2VLImageProcessorPil(size=dict(ip.size), patch_size=ip.patch_size, merge_size=ip.merge_size,
                                  temporal_patch_size=ip.temporal_patch_size, image_mean=ip.image_mean,
                                  image_std=ip.image_std)  # fmt: skip
    want = hf(images=[Image.fromarray(frame)], return_tensors="pt")
    assert out["video_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 4, 6]]
    got = scale_pixels(out["pixel_values_videos"], load_pixel_table("dummy:"))
    torch.testing.assert_close(got, want["pixel_values"], rtol=0, atol=0)


def test_video_patches_follow_time_then_merge_order(processor):
    # distinct frames, an odd count (the last is repeated): each row is one patch of `tp` frames, taken in
    # time groups, then merge blocks row by row, then the patches inside a block, as [C, tp, P, P]
    vp = processor.video_processor
    tp, ps, ms = vp.temporal_patch_size, vp.patch_size, vp.merge_size
    frames = np.random.default_rng(2).integers(0, 256, (3, 2 * ms * ps, 3 * ms * ps, 3), dtype=np.uint8)
    out = vp([frames])
    padded = np.concatenate([frames, frames[-1:]])
    want = []
    for g in range(2):
        for by in range(2):
            for bx in range(3):
                for iy in range(ms):
                    for ix in range(ms):
                        y, x = (by * ms + iy) * ps, (bx * ms + ix) * ps
                        patch = padded[g * tp:(g + 1) * tp, y:y + ps, x:x + ps]  # [tp, P, P, C]
                        want.append(patch.transpose(3, 0, 1, 2).reshape(-1))
    assert out["video_grid_thw"].tolist() == [[2, 2 * ms, 3 * ms]]
    torch.testing.assert_close(out["pixel_values_videos"], torch.from_numpy(np.stack(want)), rtol=0, atol=0)


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
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    lengths = inputs["feature_attention_mask"].sum(-1) if with_audio else None
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, None, lengths,
                      inputs["video_grid_thw"], inputs["video_second_per_grid"])  # fmt: skip
    codes, _ = run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 0))
    assert torch.equal(codes, want_codes)


def test_video_placeholder_counts_that_differ_from_its_grid_are_refused(clip, hf_model, processor):
    """A video prompt whose video (or track) placeholder count is not its media's token count is the
    client's error, found at admission (ThinkerRunner.validate), before any step runs it."""
    from dataclasses import replace

    inputs = prepare_inputs(processor, _messages(clip), use_audio_in_video=True)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=2, max_seq_len=1024, device="cpu",
                            dtype=torch.float32)  # fmt: skip
    prompt = _thinker_prompt(inputs, True)
    thinker.validate(running("ok", SamplingParams(max_tokens=REPLY), prompt, slot=0))  # as the processor makes it
    for token, what in ((VIDEO_PAD, "video"), (AUDIO_PAD, "audio")):
        extra = replace(prompt, input_ids=torch.cat([prompt.input_ids, torch.tensor([token])]))
        with pytest.raises(BadRequestError, match=f"placeholder tokens for .* {what} tokens"):
            thinker.validate(running("bad", SamplingParams(max_tokens=REPLY), extra, slot=0))

def _thinker_prompt(inputs: dict, with_audio: bool) -> ThinkerPrompt:
    return ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                         inputs.get("input_features"), inputs.get("feature_attention_mask"), export_talker=True,
                         pixel_values_videos=inputs.get("pixel_values_videos"), video_grid_thw=inputs.get("video_grid_thw"),
                         video_second_per_grid=inputs.get("video_second_per_grid"), use_audio_in_video=with_audio)  # fmt: skip


def _talker_codes(talker, out, inputs: dict, slot: int) -> torch.Tensor:
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"), lengths,
                      inputs.get("video_grid_thw"), inputs.get("video_second_per_grid"))  # fmt: skip
    codes, _ = run_talker(talker, running(f"a{slot}", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, slot))
    return codes


def _decode_all(runner, results) -> dict:
    outs = {}
    while True:
        for r in results:
            if r.output is not None:
                rid = r.seq.request_id
                outs[rid] = outs[rid].merge(r.output) if rid in outs else r.output
        going = [r.seq for r in results if r.finish_reason is None]
        if not going:
            return outs
        results = runner.decode(going)


def test_videos_with_and_without_their_audio_prefill_in_one_step_with_audio_and_text(clip, hf_model, processor,
                                                                                      monkeypatch):  # fmt: skip
    """One thinker prefill step of a video with its audio track, the same video without it, an audio prompt
    and a text prompt: one MediaPrefill forward over all four rows, one call per encoder (the frames of
    both videos in one vision call, the track and the clip in one audio call), no prompt in chunks; each
    prompt's text tokens and codec codes equal generate()'s for it alone."""
    cases = [(prepare_inputs(processor, _messages(clip), use_audio_in_video=True), True),
             (prepare_inputs(processor, _messages(clip, "Describe the frames.")), False),
             (prepare_inputs(processor, oracle.messages("audio")), False),
             (prepare_inputs(processor, oracle.messages("text")), False)]  # fmt: skip
    kw = dict(max_slots=5, max_seq_len=1024, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    assert all(x["input_ids"].shape[1] <= thinker.media_prefill.max_tokens for x, _ in cases)
    calls = {"rows": [], "audio": 0, "vision": 0}
    run = thinker.media_prefill.run
    monkeypatch.setattr(thinker.media_prefill, "run", lambda rows, *a: calls["rows"].append(len(rows)) or run(rows, *a))
    for name in ("audio", "vision"):
        encoder = getattr(thinker.media, name)
        monkeypatch.setattr(thinker.media, name, lambda *a, _e=encoder, _n=name: calls.update({_n: calls[_n] + 1}) or _e(*a))
    monkeypatch.setattr(thinker, "_long_pieces", lambda seqs: pytest.fail("a prompt prefilled in chunks"))
    seqs = [running(f"t{i}", SamplingParams(max_tokens=REPLY), _thinker_prompt(x, a), slot=i + 1)
            for i, (x, a) in enumerate(cases)]  # fmt: skip
    for s in seqs:
        thinker.validate(s)
    outs = _decode_all(thinker, thinker.prefill(seqs))
    assert calls == {"rows": [4], "audio": 1, "vision": 1}
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    for i, (x, with_audio) in enumerate(cases):
        want_text, want_codes, _ = oracle.generate(hf_model, dict(x, use_audio_in_video=with_audio), REPLY, FRAMES)
        assert outs[f"t{i}"].token_ids == want_text, i
        assert torch.equal(_talker_codes(talker, outs[f"t{i}"], x, 0), want_codes), i


def test_the_same_video_twice_is_served_from_the_prefix_cache(clip, hf_model, processor, monkeypatch):
    """A second request with the same video (and its track) encodes nothing: its kept prefix holds every
    media row (the question after the video fills the block where it ends), only its text tail prefills
    (ChunkPrefill), it reports the cached tokens, and its reply and codec codes equal generate()'s."""
    question = "What happens here? Describe every moving part of the picture, frame by frame, in detail."
    inputs = prepare_inputs(processor, _messages(clip, question), use_audio_in_video=True)
    want_text, want_codes, _ = oracle.generate(hf_model, dict(inputs, use_audio_in_video=True), REPLY, FRAMES)
    kw = dict(max_slots=3, max_seq_len=1024, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, prefix_cache_bytes=8 << 20, **kw)
    first = running("first", SamplingParams(max_tokens=REPLY), _thinker_prompt(inputs, True), slot=1)
    thinker.validate(first)
    out, _ = run_thinker(thinker, first)
    assert out.token_ids == want_text and out.cached_tokens == 0
    thinker.release(first)
    monkeypatch.setattr(thinker.media, "rows", lambda *a: pytest.fail("the same video encoded again"))
    chunks = []
    chunk_run = thinker.chunk_prefill.run
    monkeypatch.setattr(thinker.chunk_prefill, "run", lambda embeds, *a: chunks.append(len(embeds)) or chunk_run(embeds, *a))
    second = running("second", SamplingParams(max_tokens=REPLY), _thinker_prompt(inputs, True), slot=2)
    thinker.validate(second)
    out, _ = run_thinker(thinker, second)
    assert chunks == [1]
    last_video = inputs["input_ids"][0].tolist()[::-1].index(VIDEO_PAD)
    assert out.cached_tokens > inputs["input_ids"].shape[1] - 1 - last_video  # past the video's last row
    assert out.token_ids == want_text
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    assert torch.equal(_talker_codes(talker, out, inputs, 0), want_codes)


def test_a_video_longer_than_the_media_buffers_prefills_in_pieces_beside_a_text_stream(hf_model, processor):
    """A video with its audio track longer than the media buffers goes in pieces of whole chunks (its frames,
    its track's rows and their deepstack rows cut between steps), a short text stream decoding between them;
    the video's reply and codec codes (its talker prompt in pieces too) and the stream's reply equal
    generate()'s. Sent again, it starts after the blocks its first prefill kept, the media whole in them."""
    from omnistage.stages.long_prefill import CHUNK_TOKENS

    from .test_chunked_prefill import RUNNER, serve

    long_clip = make_video(seconds=4.0, fps=10, width=96, height=64, audio=True, seed=3)
    question = "What happens here? Describe every moving part of the picture, frame by frame, in detail."
    inputs = prepare_inputs(processor, _messages(long_clip, question), use_audio_in_video=True)
    n = inputs["input_ids"].shape[1]
    assert CHUNK_TOKENS < n < 2 * CHUNK_TOKENS
    short = prepare_inputs(processor, oracle.messages("text"))
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, prefix_cache_bytes=8 << 20, **RUNNER)
    got, steps = serve(thinker, CHUNK_TOKENS, [
        ("short", SamplingParams(max_tokens=2 * REPLY, ignore_eos=True), ThinkerPrompt(short["input_ids"][0])),
        ("video", SamplingParams(max_tokens=REPLY, ignore_eos=True), _thinker_prompt(inputs, True)),
    ])  # fmt: skip
    assert steps.pieces("video") == [(0, CHUNK_TOKENS), (CHUNK_TOKENS, n)]
    assert steps.decodes_between_pieces("video", "short") == [1]
    want_text, want_codes, _ = oracle.generate(hf_model, dict(inputs, use_audio_in_video=True), REPLY, FRAMES)
    assert got["video"].token_ids == want_text and got["video"].cached_tokens == 0
    assert got["short"].token_ids == oracle.generate(hf_model, short, 2 * REPLY, FRAMES)[0]

    again, steps = serve(thinker, CHUNK_TOKENS, [
        ("video", SamplingParams(max_tokens=REPLY, ignore_eos=True), _thinker_prompt(inputs, True)),
    ])  # fmt: skip
    cached = again["video"].cached_tokens
    last_media = max(i for i, t in enumerate(inputs["input_ids"][0].tolist()) if t in (VIDEO_PAD, AUDIO_PAD))
    assert cached > last_media and steps.pieces("video") == [(cached, n)]
    assert again["video"].token_ids == want_text
    torch.testing.assert_close(again["video"].talker.media_rows, got["video"].talker.media_rows, rtol=1e-4, atol=1e-5)

    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **RUNNER)
    out = got["video"]
    prompt = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, None,
                          inputs["feature_attention_mask"].sum(-1), inputs["video_grid_thw"],
                          inputs["video_second_per_grid"])  # fmt: skip
    codes, steps = serve(talker, CHUNK_TOKENS, [("video", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05),
                                                 prompt)])  # fmt: skip
    assert len(steps.pieces("video")) == 2
    assert torch.equal(codes["video"].codes, want_codes)


@pytest.mark.gpu
@torch.inference_mode()
def test_long_video_pieces_as_graphs_equal_one_eager_pass_on_cuda(tiny_checkpoint, processor):
    """As served on CUDA (bf16, graphs, rows padded to the chunk): a video with its track longer than the media
    buffers, prefilled in two pieces, leaves in its slot the K/V and gives the first token and the talker's
    media rows of the prompt prefilled in one piece at exact sizes without graphs, within bf16 rounding (the
    first token: the top logit within it)."""
    from .test_chunked_prefill import (assert_close_in_bf16, assert_same_pick_in_bf16,
                                       pieces_as_graphs_and_whole_eager_on_cuda)

    long_clip = make_video(seconds=4.0, fps=10, width=96, height=64, audio=True, seed=3)
    inputs = prepare_inputs(processor, _messages(long_clip), use_audio_in_video=True)
    prompt = _thinker_prompt(inputs, True)
    n = prompt.input_ids.numel()
    result, want, graphs, eager = pieces_as_graphs_and_whole_eager_on_cuda(tiny_checkpoint, prompt)
    assert_same_pick_in_bf16(graphs, eager, result, want)
    assert_close_in_bf16(result.output.talker.media_rows, want.output.talker.media_rows)
    assert_close_in_bf16(slot_kv(graphs.cache, 1, n), slot_kv(eager.cache, 1, n))
