# Code2WavRunner on a tiny random Code2Wav (1 transformer layer, sliding window 72): streamed == full decode.
# The tiny model's waveform is ~1e-6 in amplitude, so every comparison is relative to max|reference|.
import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.core.chunking import ChunkSchedule
from omnistage.core.errors import BadRequestError
from omnistage.stages.code2wav import Code2WavRunner

TINY_CODE2WAV = dict(
    codebook_size=2048,
    num_quantizers=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    sliding_window=72,
    max_position_embeddings=8000,
    upsample_rates=[8, 5, 4, 3],  # with upsampling_ratios: 1920 samples per frame, as in the real model
    upsampling_ratios=[2, 2],
    decoder_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
N_FRAMES = 150  # schedule 4 / 25: windows end at 4, 29, 54, 79, 104, 129, then 150 on finish


def build_tiny(seed=0):
    torch.manual_seed(seed)
    return Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**TINY_CODE2WAV), dtype=torch.float32)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_codes(frames, seed):
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return Code2WavRunner(build_tiny(), "cpu", torch.float32)


@pytest.fixture(scope="module")
def codes():
    return random_codes(N_FRAMES, seed=1)


@pytest.fixture(scope="module")
def full(runner, codes):
    wav = runner.decode([(codes, 0)])[0]
    assert wav.abs().max() > 0
    return wav


def stream(runner, codes, schedule, pushes):
    """Decodes `codes` window by window as the orchestrator would; returns the concatenated samples."""
    cutter = schedule.cutter()
    windows = [w for n in pushes for w in cutter.push(n)] + cutter.finish()
    pieces = runner.decode([(codes[w.decode_start : w.end], w.context) for w in windows])
    for w, piece in zip(windows, pieces):
        assert piece.shape[0] == runner.output_samples(w.frames, w.context)
    return torch.cat(pieces), windows


def test_geometry_measured(runner, full):
    assert (runner.samples_per_frame, runner.tail_samples) == (1920, 555)
    assert full.shape == (N_FRAMES * 1920 - 555,)
    assert full.dtype == torch.float32


def test_decode_matches_module(runner, codes):
    with torch.inference_mode():
        ref = runner.module(codes[:12].T[None])[0, 0]  # [16, T] -> [1, 1, samples]
    assert rel_err(runner.decode([(codes[:12], 0)])[0], ref) < 1e-5


def test_stream_equals_full_decode_with_enough_context(runner, codes, full):
    # 100 frames of left context > the 1-layer model's receptive field (71 frames back): no deviation.
    streamed, windows = stream(runner, codes, ChunkSchedule(4, 25, 100), [1] * N_FRAMES)
    assert [w.end for w in windows] == [4, 29, 54, 79, 104, 129, 150]
    assert streamed.shape == full.shape
    assert rel_err(streamed, full) < 1e-5


def test_stream_default_context_is_exact_in_length_and_continuous(runner, codes, full):
    streamed, windows = stream(runner, codes, ChunkSchedule(), [3, 1, 30, 100, 16])
    assert streamed.shape == full.shape
    # Windows that see all earlier frames (the first two) are exact; later ones miss frames beyond 25 back
    # (measured: rel. error 3.5e-3 over the whole stream on this model).
    exact = windows[1].end * 1920 - 555
    assert rel_err(streamed[:exact], full[:exact]) < 1e-5
    assert rel_err(streamed, full) < 1e-2
    # No gap or jump at the seams: the step across each boundary is what the full decode has there.
    scale = full.abs().max()
    for w in windows[:-1]:
        b = w.end * 1920 - 555
        step, ref_step = streamed[b] - streamed[b - 1], full[b] - full[b - 1]
        assert (step - ref_step).abs() < 1e-2 * scale


def test_batched_equals_alone(runner):
    windows = [
        (random_codes(10, 2), 0),
        (random_codes(29, 3), 4),
        (random_codes(10, 4), 3),
        (random_codes(50, 5), 25),
        (random_codes(29, 6), 25),
        (random_codes(50, 7), 0),
        (random_codes(1, 8), 0),
    ]
    forwards = []
    hook = runner.module.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape))
    try:
        batched = runner.decode(windows)
    finally:
        hook.remove()
    assert sorted(tuple(s) for s in forwards) == [(1, 16, 1), (2, 16, 10), (2, 16, 29), (2, 16, 50)]
    for (codes, context), got in zip(windows, batched):
        alone = runner.decode([(codes, context)])[0]
        assert got.shape == alone.shape == (runner.output_samples(codes.shape[0], context),)
        assert rel_err(got, alone) < 1e-5


def test_empty_batch(runner):
    assert runner.decode([]) == []


def test_int32_codes_accepted(runner):
    codes = random_codes(8, 9)
    a, b = runner.decode([(codes, 2), (codes.to(torch.int32), 2)])
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize(
    "codes, context, match",
    [
        (torch.zeros(8, 15, dtype=torch.long), 0, r"\[frames >= 1, 16\]"),
        (torch.zeros(8, dtype=torch.long), 0, r"\[frames >= 1, 16\]"),
        (torch.zeros(1, 8, 16, dtype=torch.long), 0, r"\[frames >= 1, 16\]"),
        (torch.zeros(0, 16, dtype=torch.long), 0, r"\[frames >= 1, 16\]"),
        (torch.zeros(8, 16), 0, "integers"),
        (torch.zeros(8, 16, dtype=torch.bool), 0, "integers"),
        ([[0] * 16] * 8, 0, "tensor"),
        (torch.full((8, 16), 2048), 0, r"\[0, 2048\)"),
        (torch.full((8, 16), -1), 0, r"\[0, 2048\)"),
        (torch.zeros(8, 16, dtype=torch.long), 8, "context_frames"),
        (torch.zeros(8, 16, dtype=torch.long), -1, "context_frames"),
        (torch.zeros(8, 16, dtype=torch.long), 1.0, "context_frames"),
        (torch.zeros(8, 16, dtype=torch.long), True, "context_frames"),
    ],
)
def test_bad_window_raises(runner, codes, context, match):
    good = (torch.zeros(8, 16, dtype=torch.long), 0)
    with pytest.raises(BadRequestError, match=match) as info:
        runner.decode([good, (codes, context)])
    assert "window 1" in str(info.value)
    with pytest.raises(BadRequestError, match=match):
        runner.validate(codes, context)


def test_bad_value_fails_before_any_forward(runner):
    bad = torch.zeros(4, 16, dtype=torch.long)
    bad[2, 7] = 4096
    forwards = []
    hook = runner.module.register_forward_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(BadRequestError, match="window 2"):
            runner.decode([(random_codes(10, 1), 0), (random_codes(4, 2), 0), (bad, 1)])
    finally:
        hook.remove()
    assert forwards == []


def test_dtype_mismatch_rejected():
    with pytest.raises(ValueError, match="bfloat16"):
        Code2WavRunner(build_tiny(), "cpu", torch.bfloat16)


def test_cpu_conv_flags_restored(runner, codes):
    before = torch.backends.mkldnn.enabled, torch._C._get_nnpack_enabled()
    runner.decode([(codes[:6], 0)])
    assert (torch.backends.mkldnn.enabled, torch._C._get_nnpack_enabled()) == before


def test_seeded_builds_are_identical():
    a, b = build_tiny(), build_tiny()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
