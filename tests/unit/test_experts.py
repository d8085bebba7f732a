# Our experts implementations: gather_or_grouped gives the same MoE output as transformers' own per-expert
# loop on both of its paths (few pairs: gathered bmm; many: lean grouped_mm), for thinker and talker experts;
# lean_grouped_mm gives transformers' grouped_mm output and the gathered path its batched_mm output.
import pytest
import torch

from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

from omnistage.models import experts, fused_ops, fused_projections, gemv
from omnistage.models.checkpoint import load_stage

needs_triton = pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
# the fused kernels on the CPU through Triton's interpreter (tests/conftest.py), and compiled on a GPU
on_cpu_and_cuda = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


def _experts_modules(model):
    return [m for m in model.modules() if experts.is_experts_module(m)]


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("tokens", [1, 2, 32])  # 2 and 4 pairs per token: gather, gather, grouped
def test_gather_or_grouped_matches_the_eager_loop(stage, tokens):
    model = load_stage("dummy:tiny", stage, dtype=torch.float32, seed=1, experts_implementation=experts.NAME)
    module = _experts_modules(model)[0]
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=g)
    top_k = 2
    index = torch.stack([torch.randperm(module.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    got = module(hidden, index, weights)  # dispatched through config._experts_implementation
    assert module.config._experts_implementation == experts.NAME
    module.config._experts_implementation = "eager"
    try:
        want = module(hidden, index, weights)
    finally:
        module.config._experts_implementation = experts.NAME
    scale = want.abs().max()  # dummy weights are small: the tolerance must follow the output's size
    assert scale > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_the_path_follows_the_pair_count(monkeypatch):
    calls = []
    monkeypatch.setattr(experts, "gathered_experts_forward", lambda *a: calls.append("gather"))
    monkeypatch.setattr(experts, "lean_grouped_mm_experts_forward", lambda *a: calls.append("grouped"))
    for tokens in (1, experts.GATHER_MAX_PAIRS // 8, experts.GATHER_MAX_PAIRS // 8 + 1):
        experts.gather_or_grouped_experts_forward(None, torch.zeros(tokens, 4), torch.zeros(tokens, 8), None)
    assert calls == ["gather", "gather", "grouped"]


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 32])
def test_lean_grouped_mm_equals_transformers_grouped_mm(stage, dtype, tokens):
    model = load_stage("dummy:tiny", stage, dtype=dtype, seed=2, experts_implementation=experts.LEAN_NAME)
    module = _experts_modules(model)[0]
    hidden, index, weights = _routed(module, tokens, dtype)
    got = module(hidden, index, weights)
    want = grouped_mm_experts_forward(module, hidden, index, weights)
    assert got.dtype == want.dtype == dtype and got.abs().max() > 0
    assert torch.equal(got, want)  # the same ops in the same order, without the sentinel passes


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
def test_gathered_experts_equal_transformers_batched_mm(stage, dtype, tokens):
    model = load_stage("dummy:tiny", stage, dtype=dtype, seed=2, experts_implementation=experts.NAME)
    module = _experts_modules(model)[0]
    hidden, index, weights = _routed(module, tokens, dtype)
    got = experts.gathered_experts_forward(module, hidden, index, weights)
    want = batched_mm_experts_forward(module, hidden, index, weights)
    assert got.dtype == want.dtype == dtype and got.abs().max() > 0
    assert torch.equal(got, want)  # the same ops in the same order, without the sentinel clamp


@needs_triton
@on_cpu_and_cuda
@pytest.mark.parametrize("path", ["grouped", "gathered"])
def test_experts_with_the_fused_epilogues(monkeypatch, device, path):
    # silu(gate) * up and the way back to the tokens as Triton kernels (on the CPU through Triton's interpreter, see tests/conftest.py)
    if device == "cpu":
        monkeypatch.setattr(fused_projections, "fused_tensor", lambda t: True)
    calls = []
    silu_mul = fused_projections.silu_mul
    monkeypatch.setattr(fused_projections, "silu_mul", lambda x: calls.append(x.shape) or silu_mul(x))
    combined = []
    combine = fused_projections.combine_experts
    monkeypatch.setattr(fused_projections, "combine_experts", lambda *a: combined.append(1) or combine(*a))
    gemv_silu = []  # the gathered path's GEMV takes silu(gate) * up on its way in (gemv.py)
    real_gemv = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: gemv_silu.append(kw.get("silu_mul")) or real_gemv(*a, **kw))
    model = load_stage("dummy:tiny", "thinker", dtype=torch.bfloat16, seed=3, experts_implementation=experts.NAME)
    module = _experts_modules(model)[0].to(device)
    assert not getattr(module, "fused_epilogues", False)  # only where the fused kernels installed it
    fused_projections.install(model)
    assert module.fused_epilogues
    tokens = 16 if path == "grouped" else 1  # 4 pairs per token (_routed): grouped beyond GATHER_MAX_PAIRS
    hidden, index, weights = (t.to(device) for t in _routed(module, tokens, torch.bfloat16))
    got = module(hidden, index, weights)  # gather_or_grouped
    want = (grouped_mm_experts_forward if path == "grouped" else batched_mm_experts_forward)(module, hidden, index,
                                                                                               weights)  # fmt: skip
    assert combined and got.dtype == torch.bfloat16
    assert (gemv_silu == [None, True]) if path == "gathered" else (calls and not gemv_silu)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * scale)


def _routed(module, tokens: int, dtype):
    """Hidden states and a router's top-k picks (with softmax weights, as the sparse MoE block gives them)."""
    g = torch.Generator().manual_seed(tokens)
    top_k = 4
    hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=g).to(dtype)
    index = torch.stack([torch.randperm(module.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(dtype)
    return hidden, index, weights


@needs_triton
@on_cpu_and_cuda
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_combine_experts_equals_unsort_weight_and_sum(device, weights_dtype):
    # transformers' way back to the tokens (unsort, weight, sum over k) as one kernel, bit for bit
    g = torch.Generator().manual_seed(5)
    tokens, top_k, width = 7, 4, 96
    down = torch.randn(tokens * top_k, width, generator=g).to(device, torch.bfloat16)
    perm = torch.randperm(tokens * top_k, generator=g).to(device)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(device, weights_dtype)
    unsorted = torch.empty_like(down)
    unsorted[perm] = down
    want = (unsorted.view(tokens, top_k, width) * weights.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    positions = torch.empty_like(perm)
    positions[perm] = torch.arange(perm.numel(), device=device)
    got = fused_projections.combine_experts(down, positions.view(tokens, top_k), weights, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_triton
@on_cpu_and_cuda
@pytest.mark.parametrize("tokens, top_k, n_experts", [(1, 8, 128), (64, 8, 128), (201, 4, 6), (5, 2, 100),
                                                       (300, 8, 128)])  # fmt: skip
def test_expert_order_is_a_stable_sort_by_expert(device, tokens, top_k, n_experts):
    # 300 x 8 pairs: more than one pass of EXPERT_ORDER_BLOCK, each expert's run across passes
    g = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    got = fused_projections.expert_order(index, n_experts)
    want = _sorted_order(index, n_experts)
    assert got[0].dtype == torch.int32 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@needs_triton
@on_cpu_and_cuda
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_experts_in_the_kernels_order_equal_those_in_a_sorts(monkeypatch, device, stage):
    # the fused path's output, bit for bit, with its pairs ordered by expert_order and by torch's stable sort
    if device == "cpu":
        monkeypatch.setattr(fused_projections, "fused_tensor", lambda t: True)
    model = load_stage("dummy:tiny", stage, dtype=torch.bfloat16, seed=4, experts_implementation=experts.LEAN_NAME)
    module = _experts_modules(model)[0].to(device)
    fused_projections.install(model)
    hidden, index, weights = (t.to(device) for t in _routed(module, 24, torch.bfloat16))
    ordered = []
    order = fused_projections.expert_order
    monkeypatch.setattr(fused_projections, "expert_order", lambda *a: ordered.append(1) or order(*a))
    got = module(hidden, index, weights)
    monkeypatch.setattr(fused_projections, "expert_order", _sorted_order)
    want = module(hidden, index, weights)
    assert ordered == [1] and got.abs().max() > 0 and torch.equal(got, want)


def _sorted_order(top_k_index, n_experts):
    """expert_order's outputs from torch's stable sort."""
    tokens, top_k = top_k_index.shape
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    ends = torch.cumsum(torch.bincount(ids, minlength=n_experts), 0, dtype=torch.int32)
    positions = torch.empty_like(perm)
    positions[perm] = torch.arange(perm.numel(), device=perm.device)
    return ends, perm // top_k, positions.view(tokens, top_k)
