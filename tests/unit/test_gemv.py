# The one- and two-row matmul kernel (omnistage/models/gemv.py, run by Triton's CPU interpreter here, see
# tests/conftest.py) gives F.linear's result up to the order of the float32 sum, for plain weights and for
# expert weights picked per row, and linear() keeps F.linear wherever the kernel does not apply.
import pytest
import torch

from omnistage.models import fused_ops, fused_projections, gemv

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _close(got, want):
    scale = float(want.abs().max())
    tol = 1e-5 if want.dtype == torch.float32 else 2**-7  # bf16: one rounding step, now and then
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (2, 200, 36), (1, 1030, 20)])  # ragged K and N blocks
def test_gemv_matches_linear(device, dtype, rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    got = gemv.gemv(x, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    _close(got, (x.float() @ w.float().T).to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_reads_each_rows_expert_in_place(device, dtype):
    g = torch.Generator().manual_seed(3)
    tokens, top_k, experts, k, n = 2, 3, 5, 48, 40
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    w = torch.randn(experts, n, k, generator=g).to(device, dtype)
    ids = torch.tensor([4, 0, 2, 2, 1, 3], device=device)  # pair (t, j) at row t * top_k + j
    got = gemv.gemv(x, w, ids, rows_per_x=top_k)
    want = torch.stack([x[m // top_k].float() @ w[ids[m]].float().T for m in range(tokens * top_k)]).to(dtype)
    _close(got, want)


def test_linear_takes_the_kernel_only_for_few_rows_without_bias(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(tuple(x.shape)) or x @ w.T)
    w, bias = torch.randn(6, 8), torch.randn(6)
    monkeypatch.setattr(gemv, "MAX_ROWS", 2)
    for x in (torch.randn(1, 1, 8), torch.randn(2, 8), torch.randn(3, 8), torch.randn(1, 3, 8)):
        torch.testing.assert_close(gemv.linear(x, w), torch.nn.functional.linear(x, w))
    gemv.linear(torch.randn(1, 8), w, bias)
    monkeypatch.setattr(gemv, "enabled", False)
    gemv.linear(torch.randn(1, 8), w)
    assert calls == [(1, 8), (2, 8)]  # more than MAX_ROWS rows, a bias, or the kernel turned off: F.linear


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_ids", [False, True])
def test_gemv_with_silu_mul_equals_silu_mul_then_gemv(device, dtype, with_ids):
    """silu(gate) * up computed on the way into the GEMV rounds as fused_projections.silu_mul's kernel, so
    the result is the two kernels' bit for bit (same sums in the same order)."""
    g = torch.Generator().manual_seed(11)
    rows, k, n = 3, 72, 40
    gate_up = (torch.randn(rows, 2 * k, generator=g) * 3).to(device, dtype)
    w = torch.randn(4, n, k, generator=g).to(device, dtype) if with_ids else torch.randn(n, k, generator=g).to(device, dtype)
    ids = torch.tensor([3, 0, 3], device=device) if with_ids else None
    got = gemv.gemv(gate_up, w, ids, silu_mul=True)
    want = gemv.gemv(fused_projections.silu_mul(gate_up), w, ids)
    assert torch.equal(got, want)
    assert not torch.equal(got, gemv.gemv(gate_up[:, :k].contiguous(), w, ids))  # the up half matters


def test_silu_mul_linear_routes_like_linear(monkeypatch):
    """One row through the fused GEMV, more rows (or a bias) through silu_mul then F.linear: same values."""
    g = torch.Generator().manual_seed(12)
    w, bias = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append(kw.get("silu_mul")) or real(*a, **kw))
    for shape, b in (((1, 1, 16), None), ((3, 16), None), ((1, 16), bias)):
        x = torch.randn(*shape, generator=g)
        want = torch.nn.functional.linear(fused_projections.silu_mul(x), w, b)
        torch.testing.assert_close(fused_projections.silu_mul_linear(x, w, b), want, rtol=1e-5, atol=1e-5)
    assert calls == [True]
