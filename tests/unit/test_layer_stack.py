# run_layers (omnistage/models/layer_stack.py) gives what calling transformers' decoder layers one after the
# other and then the final norm gives: with transformers' ops (every CPU step), and with each residual add
# fused into the next RMSNorm by fused_ops.add_rms_norm (run by Triton's CPU interpreter, see tests/conftest.py).
import pytest
import torch

from omnistage.models import fused_ops, fused_projections
from omnistage.models.checkpoint import load_stage
from omnistage.models.layer_stack import run_layers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _stacks(dtype, device):
    """The talker's MoE text stack and its code predictor's dense stack (tiny checkpoint)."""
    talker = load_stage("dummy:tiny", "talker", dtype=dtype, seed=4).to(device)
    return {"talker": talker.model, "code_predictor": talker.code_predictor.model}


def _layer_by_layer(model, hidden, final_norm, **kwargs):
    for layer in model.layers:
        hidden = layer(hidden, **kwargs)
    return hidden if final_norm is None else final_norm(hidden)


def _inputs(model, dtype, device, seq=5):
    g = torch.Generator().manual_seed(seq)
    hidden = torch.randn(2, seq, model.config.hidden_size, generator=g).to(device, dtype)
    positions = torch.arange(seq, device=device)[None].expand(2, seq)
    if "talker" in type(model).__name__.lower() and "predictor" not in type(model).__name__.lower():
        positions = positions[None].expand(3, 2, seq)  # the talker's MRoPE takes a position per section
    return hidden, {"attention_mask": None, "position_embeddings": model.rotary_emb(hidden, positions)}


@pytest.mark.parametrize("stack", ["talker", "code_predictor"])
@pytest.mark.parametrize("final", [True, False])
def test_run_layers_equals_the_layers_one_by_one(stack, final):
    model = _stacks(torch.float32, "cpu")[stack]
    hidden, kwargs = _inputs(model, torch.float32, "cpu")
    norm = model.norm if final else None
    with torch.no_grad():
        got, want = run_layers(model.layers, hidden, norm, **kwargs), _layer_by_layer(model, hidden, norm, **kwargs)
    assert got.abs().max() > 0 and torch.equal(got, want)


@pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stack", ["talker", "code_predictor"])
def test_run_layers_with_fused_add_norm(monkeypatch, device, dtype, stack):
    if device == "cpu":
        monkeypatch.setattr(fused_projections, "fused_tensor", lambda t: True)
    calls = []
    add_rms_norm = fused_ops.add_rms_norm
    monkeypatch.setattr(fused_ops, "add_rms_norm", lambda *a: calls.append(1) or add_rms_norm(*a))
    model = _stacks(dtype, device)[stack]
    fused_ops.install(model)
    hidden, kwargs = _inputs(model, dtype, device)
    with torch.no_grad():
        got = run_layers(model.layers, hidden, model.norm, **kwargs)
        want = _layer_by_layer(model, hidden, model.norm, **kwargs)
    assert len(calls) == 2 * len(model.layers)  # every residual add went into the norm after it
    scale = float(want.abs().max())
    if dtype == torch.float32:  # the kernel sums the squares in another order than torch's mean
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    elif device == "cuda":  # and CUDA's rsqrt may differ in its last bit (test_fused_ops)
        torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * scale)
    else:
        assert torch.equal(got, want)  # bf16: the same roundings in the same places


@pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_add_then_norm(device, dtype):
    norm = load_stage("dummy:tiny", "talker", dtype=dtype).model.norm.to(device)
    n = norm.weight.shape[0]
    g = torch.Generator().manual_seed(7)
    norm.weight = torch.nn.Parameter((torch.randn(n, generator=g) + 1).to(device, dtype))
    x, residual = ((torch.randn(3, 4, n, generator=g) * 3).to(device, dtype) for _ in range(2))
    total, normed = fused_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    want_total = residual + x
    assert torch.equal(total, want_total)  # the add rounds once, as torch's
    want = type(norm).forward(norm, want_total)
    if device == "cuda" and dtype == torch.bfloat16:
        torch.testing.assert_close(normed, want, rtol=2**-7, atol=2**-7)
    else:
        torch.testing.assert_close(normed, want, rtol=1e-6, atol=1e-6)
