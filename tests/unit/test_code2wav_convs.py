# Code2Wav's causal convolutions without their pad and crop copies (omnistage/models/code2wav_convs.py)
# give transformers' results: each swapped module alone, the whole vocoder, and a stream decoded chunk by
# chunk with carried state; the one-channel output conv's Triton kernel runs in Triton's CPU interpreter.
import copy

import pytest
import torch

from omnistage.models import code2wav_convs, fused_ops
from omnistage.stages.code2wav import Code2WavRunner

from .test_code2wav import build, full_decode, random_codes, rel_err, stream

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def pair():
    original = build(seed=4)
    swapped = copy.deepcopy(original)
    return original, swapped, code2wav_convs.install(swapped)


def test_install_swaps_every_conv_of_the_stack(pair):
    original, _, swapped = pair
    convs = [m for m in original.modules()
             if type(m).__name__ in (code2wav_convs.CAUSAL_CONV, code2wav_convs.TRANS_CONV)]  # fmt: skip
    assert swapped == len(convs) > 10


def test_each_swapped_conv_equals_transformers(pair):
    original, swapped, _ = pair
    g = torch.Generator().manual_seed(0)
    for (name, a), (_, b) in zip(original.named_modules(), swapped.named_modules()):
        if type(a).__name__ not in (code2wav_convs.CAUSAL_CONV, code2wav_convs.TRANS_CONV):
            continue
        x = torch.randn(2, a.conv.in_channels, 37, generator=g)
        want, got = a(x), b(x)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_swapped_vocoder_streams_like_the_original(pair):
    original, swapped, _ = pair
    codes = random_codes(60, seed=5)
    full = full_decode(Code2WavRunner(original, "cpu", torch.float32), codes)
    assert rel_err(full_decode(Code2WavRunner(swapped, "cpu", torch.float32), codes), full) < 1e-5
    assert rel_err(stream(Code2WavRunner(swapped, "cpu", torch.float32), codes, 4, 25), full) < 1e-5


@pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_channel_conv_kernel_equals_the_causal_conv(pair, device, dtype):
    original, _, _ = pair
    final = original.decoder[-1]  # CausalConvNet(channels, 1, 7)
    assert final.conv.out_channels == 1
    final = copy.deepcopy(final).to(device, dtype)
    with torch.no_grad():
        final.conv.bias.fill_(0.375)  # the init leaves it at zero; the kernel must add it
    g = torch.Generator().manual_seed(1)
    # a view cut from a longer tensor, as the swapped convs hand it over; lengths around the block size
    for length in (5, 300):
        x = torch.randn(3, final.conv.in_channels, length + 9, generator=g).to(device, dtype)[..., :length]
        want = type(final).forward(final, x)
        got = code2wav_convs.one_channel_conv(x, final.conv, final.dilation)
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # accumulation order; one bf16 rounding at the end
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
def test_snake_reads_views_cut_from_longer_outputs():
    snake = next(m for m in build(seed=6).modules() if type(m).__name__ in fused_ops.SNAKE_CLASSES)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, snake.alpha.shape[0], 50, generator=g)[..., :41]
    got = fused_ops.snake(x, *fused_ops.snake_factors(snake))
    assert got.is_contiguous()
    torch.testing.assert_close(got, type(snake).forward(snake, x), rtol=1e-5, atol=1e-5)
