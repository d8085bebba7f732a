# The fused RMSNorm and rotary-embedding kernels (run by Triton's CPU interpreter, see tests/conftest.py)
# give what transformers' own code gives, in the layouts the decoder layers hand them; install() swaps only
# the decoder norms and leaves CPU tensors on transformers' path.
import pytest
import torch

from omnistage.models import fused_ops
from omnistage.models.checkpoint import load_stage

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
DTYPES = [torch.float32, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 5, 4, 16), (7, 48)])  # hidden rows; per-head q/k norm rows
def test_rms_norm_matches_transformers(device, dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    norm = load_stage("dummy:tiny", "talker", dtype=dtype).model.norm.to(device)
    n = shape[-1]
    norm.weight = torch.nn.Parameter((torch.randn(n, generator=g) + 1).to(dtype).to(device))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    want = type(norm).forward(norm, x)
    got = fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and device == "cuda":
        # both round alike, but CUDA's rsqrt may differ from 1/sqrt in its last float32 bit, which now and
        # then crosses a bf16 rounding boundary: one bf16 step, rarely
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_matches_transformers_on_transposed_heads(device, dtype, cos_batch):
    g = torch.Generator().manual_seed(cos_batch)
    batch, seq, heads_q, heads_k, dim = 2, 3, 4, 2, 16
    # the attention modules hand q and k over as [B, T, H, D] views transposed to [B, H, T, D]
    q = torch.randn(batch, seq, heads_q, dim, generator=g).to(dtype).to(device).transpose(1, 2)
    k = torch.randn(batch, seq, heads_k, dim, generator=g).to(dtype).to(device).transpose(1, 2)
    angles = torch.randn(cos_batch, seq, dim, generator=g)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    want_q, want_k = fused_ops._original_rope(q, k, cos, sin)
    got_q, got_k = fused_ops.rope(q, k, cos, sin)
    if device == "cuda" and dtype == torch.float32:  # the compiled kernel may fuse a product and the sum (FMA)
        torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    else:  # bf16 rounds each product, as torch does, and the interpreter runs numpy's float32 ops
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride()  # the layout of the input, as transformers' elementwise ops keep it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim", [(16, 72), (3, 16)])  # the encoder's 16 heads of 72; a head count not a power of 2
def test_vision_rope_equals_transformers_vision_rotary(device, dtype, heads, dim):
    # q and k cut from the qkv projection as the vision encoder cuts them; float32 angles per patch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb_vision

    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(37, 3, heads, dim, generator=g).to(dtype).to(device)
    cos, sin = (torch.randn(37, dim, generator=g).to(device) for _ in range(2))
    want_q, want_k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    got = fused_ops.vision_rope(qkv[:, :2], cos, sin)
    assert got.is_contiguous() and got.dtype == dtype
    # launched without FMA contraction: every product and sum rounds as torch's float32 ops, on the GPU too
    assert torch.equal(got[:, 0], want_q) and torch.equal(got[:, 1], want_k)


def test_install_swaps_decoder_norms_and_rope_only_for_cuda_tensors(monkeypatch):
    monkeypatch.setattr(fused_ops.modeling, "apply_rotary_pos_emb", fused_ops._original_rope)
    talker = load_stage("dummy:tiny", "talker", dtype=torch.float32)
    norms = [m for m in talker.modules() if type(m).__name__.endswith("RMSNorm")]
    assert fused_ops.install(talker) == len(norms) > 0
    assert fused_ops.modeling.apply_rotary_pos_emb is fused_ops._rope_forward
    calls = []
    monkeypatch.setattr(fused_ops, "rms_norm", lambda *a: calls.append("norm"))
    monkeypatch.setattr(fused_ops, "rope", lambda *a: calls.append("rope"))
    x = torch.randn(2, talker.config.text_config.hidden_size)
    torch.testing.assert_close(talker.model.norm(x), type(talker.model.norm).forward(talker.model.norm, x))
    q = torch.randn(1, 2, 3, 8)
    fused_ops._rope_forward(q, q, torch.ones(1, 3, 8), torch.zeros(1, 3, 8))
    assert calls == []  # CPU tensors: transformers' code
    monkeypatch.setattr(fused_ops, "_fusable", lambda *t: True)
    fused_ops._rope_forward(q, q, torch.ones(1, 3, 8), torch.zeros(1, 3, 8))
    assert calls == ["rope"]


def test_rope_on_views_that_are_not_dense():
    # q and k sliced out of one fused projection: their outputs cannot take the inputs' strides
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 3, 4 + 2 + 2, 16, generator=g)
    q, k = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2)
    angles = torch.randn(1, 3, 16, generator=g)
    want = fused_ops._original_rope(q, k, angles.cos(), angles.sin())
    got = fused_ops.rope(q, k, angles.cos(), angles.sin())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [7, 1500])  # one partial block; several blocks per row
def test_snake_matches_transformers(device, dtype, length):
    g = torch.Generator().manual_seed(length)
    code2wav = load_stage("dummy:tiny", "code2wav", dtype=dtype)
    snake = next(m for m in code2wav.modules() if type(m).__name__ in fused_ops.SNAKE_CLASSES).to(device)
    channels = snake.alpha.shape[0]
    with torch.no_grad():  # trained values are centred on 0 (log scale), unlike the zeros of a fresh module
        snake.alpha.copy_(torch.randn(channels, generator=g) * 0.5)
        snake.beta.copy_(torch.randn(channels, generator=g) * 0.5)
    x = (torch.randn(3, channels, length, generator=g) * 2).to(dtype).to(device)
    want = type(snake).forward(snake, x)
    got = fused_ops.snake(x, *fused_ops.snake_factors(snake))
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16:  # every op rounded alike: equal but for a rare last-bit sin difference
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_install_swaps_code2wav_snakes_only_for_cuda_tensors(monkeypatch):
    code2wav = load_stage("dummy:tiny", "code2wav", dtype=torch.float32)
    snakes = [m for m in code2wav.modules() if type(m).__name__ in fused_ops.SNAKE_CLASSES]
    norms = [m for m in code2wav.modules() if type(m).__name__ in fused_ops.NORM_CLASSES]
    assert snakes and fused_ops.install(code2wav) == len(snakes) + len(norms)
    calls = []
    monkeypatch.setattr(fused_ops, "snake", lambda *a: calls.append("snake"))
    x = torch.randn(1, snakes[0].alpha.shape[0], 5)
    assert torch.equal(snakes[0](x), type(snakes[0]).forward(snakes[0], x)) and not calls  # CPU: transformers'
