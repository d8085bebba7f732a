# The batched media encoders (stages/audio_encoder.py, stages/vision_encoder.py) against transformers' own
# encoders called on one clip or one image at a time, on the tiny checkpoint: one batched call over clips
# and images of different lengths and sizes gives each item what it gets alone.
import pytest
import torch

from omnistage.models.pixels import scale_pixels
from omnistage.models.processor import load_pixel_table
from omnistage.stages.audio_encoder import AudioEncoder, encoded_length
from omnistage.stages.vision_encoder import VisionEncoder

from .. import oracle

# mel frames: one short odd chunk, one full chunk, a full chunk and a tail, more than one attention window
# (8 chunks of the tiny config's n_window_infer) with a one-frame tail, a short even chunk
CLIP_FRAMES = [37, 100, 250, 1001, 64]
# (t, h, w) in patches: h and w multiples of the spatial merge size; t = 2 is a two-frame clip
GRIDS = [(1, 4, 4), (1, 6, 8), (1, 2, 2), (2, 4, 6)]
TABLE = load_pixel_table("dummy:")


def _clips(mels: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(mels, n, generator=g) for n in CLIP_FRAMES]


def _images(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch bytes [patches, channels] uint8 (models/pixels.py) of images of GRIDS."""
    g = torch.Generator().manual_seed(2)
    grid = torch.tensor(GRIDS)
    return torch.randint(0, 256, (int(grid.prod(-1).sum()), channels), generator=g, dtype=torch.uint8), grid


@pytest.fixture(scope="module")
def audio_tower(hf_model):
    """The tiny checkpoint's audio encoder with nonzero conv biases, as trained weights have: with zero
    biases a conv's output over padding is zero, the same as its zero padding, which would hide how a
    clip's chunks are padded."""
    import copy

    tower = copy.deepcopy(hf_model.thinker.audio_tower)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g))
    return tower


def test_audio_encoder_batch_equals_each_clip_alone(audio_tower):
    tower = audio_tower
    clips = _clips(tower.config.num_mel_bins)
    got, counts = AudioEncoder(tower)(clips)
    assert counts == [encoded_length(n, tower.config.n_window) for n in CLIP_FRAMES]
    for clip, part in zip(clips, got.split(counts)):
        with torch.no_grad():
            want = tower(clip, feature_lens=torch.tensor([clip.shape[1]])).last_hidden_state
        assert part.shape == want.shape
        assert oracle.rel_error(part, want) < 1e-5


def test_audio_encoder_output_does_not_depend_on_the_batch(audio_tower):
    """A short clip batched with longer ones (whose chunks are padded wider than it) gets what it gets alone."""
    encoder = AudioEncoder(audio_tower)
    clips = _clips(audio_tower.config.num_mel_bins)
    alone, _ = encoder(clips[:1])
    together, counts = encoder(clips[::-1])
    assert oracle.rel_error(together.split(counts)[-1], alone) < 1e-6


def test_vision_encoder_batch_equals_each_image_alone(hf_model):
    visual = hf_model.thinker.visual
    pixels, grid = _images(visual.patch_embed.proj.weight[0].numel())
    got, deepstack, counts = VisionEncoder(visual, TABLE)(pixels, grid)
    assert len(deepstack) == len(visual.config.deepstack_visual_indexes)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), grid.prod(-1).cumsum(0)]).tolist()
    for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
        with torch.no_grad():
            want = visual(scale_pixels(pixels[start:end], TABLE), grid_thw=grid[i : i + 1])
        assert counts[i] == want.pooler_output.shape[0]
        assert oracle.rel_error(got.split(counts)[i], want.pooler_output) < 1e-5
        for mine, theirs in zip(deepstack, want.deepstack_features):
            assert oracle.rel_error(mine.split(counts)[i], theirs) < 1e-5


@pytest.mark.gpu
def test_encoders_on_cuda_in_bf16_match_fp32_on_cpu(hf_model):
    """The batched encoders in bf16 on CUDA stay within bf16 rounding of the fp32 CPU run."""
    import copy

    thinker = copy.deepcopy(hf_model.thinker).to("cuda", torch.bfloat16)
    clips = _clips(thinker.config.audio_config.num_mel_bins)
    want, _ = AudioEncoder(hf_model.thinker.audio_tower)(clips)
    got, _ = AudioEncoder(thinker.audio_tower)(clips)
    assert oracle.rel_error(got.float().cpu(), want) < 5e-2
    pixels, grid = _images(thinker.visual.patch_embed.proj.weight[0].numel())
    want, _, _ = VisionEncoder(hf_model.thinker.visual, TABLE)(pixels, grid)
    got, _, _ = VisionEncoder(thinker.visual, TABLE)(pixels, grid)
    assert oracle.rel_error(got.float().cpu(), want) < 5e-2


def test_vision_encoder_over_frames_of_one_size_equals_each_item_alone(hf_model):
    """A video's frames and images of one size are attended as views of the packed tokens (Segments.even):
    each item still gets what transformers gives it alone."""
    visual = hf_model.thinker.visual
    grid = torch.tensor([(2, 4, 6), (1, 4, 6), (1, 4, 6)])
    g = torch.Generator().manual_seed(4)
    pixels = torch.randint(0, 256, (int(grid.prod(-1).sum()), visual.patch_embed.proj.weight[0].numel()),
                           generator=g, dtype=torch.uint8)  # fmt: skip
    got, deepstack, counts = VisionEncoder(visual, TABLE)(pixels, grid)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), grid.prod(-1).cumsum(0)]).tolist()
    for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
        with torch.no_grad():
            want = visual(scale_pixels(pixels[start:end], TABLE), grid_thw=grid[i : i + 1])
        assert oracle.rel_error(got.split(counts)[i], want.pooler_output) < 1e-5
        for mine, theirs in zip(deepstack, want.deepstack_features):
            assert oracle.rel_error(mine.split(counts)[i], theirs) < 1e-5


@pytest.mark.parametrize("lengths", [[6, 6, 6], [6, 2, 5]])
def test_packed_attention_equals_attention_within_each_segment(lengths):
    from omnistage.stages.packed_attention import Segments, attend

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lengths), 4, 8, generator=g) for _ in range(3))
    segments = Segments(lengths, "cpu")
    assert segments.even == (len(set(lengths)) == 1)
    got = attend(q, k, v, segments, 0.3)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        want = torch.nn.functional.scaled_dot_product_attention(*(t[part].transpose(0, 1) for t in (q, k, v)), scale=0.3)
        assert torch.allclose(got[part], want.transpose(0, 1).reshape(n, -1), atol=1e-6)
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_qk_equals_transformers_rotary(dtype):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb_vision

    from omnistage.stages.vision_encoder import rotate_qk

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(10, 3, 4, 16, generator=g).to(dtype)
    cos, sin = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    want_q, want_k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    got_q, got_k = rotate_qk(qkv[:, :2], cos, sin).unbind(1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
