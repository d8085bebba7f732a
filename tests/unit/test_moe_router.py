# The fused MoE router (omnistage/models/moe_router.py, its kernel run by Triton's CPU interpreter here, see
# tests/conftest.py) picks the experts transformers' router picks, with its weights: the softmax + top-k
# kernel alone against torch's ops, then the thinker's and talker's router modules and MoE blocks.
import copy
import types

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

from omnistage.models import fused_ops, fused_projections, gemv, moe_router
from omnistage.models.checkpoint import load_stage

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROUTERS = [modeling.Qwen3OmniMoeThinkerTextTopKRouter, modeling.Qwen3OmniMoeTalkerTextTopKRouter]


@pytest.fixture
def on_cpu_too(monkeypatch):
    monkeypatch.setattr(fused_projections, "fused_tensor", lambda t: True)


def distinct_logits(rows, experts, g):
    """Each row a permutation of experts distinct steps of 1/16 (exact in bf16): no ties for top-k to break."""
    return torch.stack([(torch.randperm(experts, generator=g) - experts / 2) / 16 for _ in range(rows)])


def reference(logits, top_k, normalize):
    """transformers' router after its logits, the weights still in float32 (before the cast)."""
    values, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


def close_weights(got, want):
    tol = 1e-6 if want.dtype == torch.float32 else 2**-8  # bf16: one rounding step of a weight below 1
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,experts,top_k", [(1, 128, 8), (5, 128, 8), (1, 128, 6), (5, 20, 3), (1, 20, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_topk_matches_torch(device, dtype, rows, experts, top_k, normalize):
    g = torch.Generator().manual_seed(rows * experts + top_k)
    logits = distinct_logits(rows, experts, g).to(device, dtype)
    weights, ids = moe_router.softmax_topk(logits, top_k, normalize)
    want_weights, want_ids = reference(logits, top_k, normalize)
    assert weights.shape == ids.shape == (rows, top_k) and weights.dtype == dtype and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)  # descending, like topk's
    if dtype == torch.float32:
        close_weights(weights, want_weights)
    else:  # rounded to nearest (a truncating cast is off by up to a whole step), up to float32's last bits
        half_step = 2.0 ** (torch.floor(torch.log2(want_weights)) - 8)
        assert ((weights.float() - want_weights).abs() <= half_step + 1e-6 * want_weights).all()
    if normalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(rows, device=device), rtol=0, atol=2**-6)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_topk_reads_strided_rows_and_breaks_ties_to_the_lower_expert(device):
    wide = torch.zeros(2, 24, device=device)
    wide[0, [3, 7, 11]] = 2.0  # three tied for the two places
    wide[1, 5] = -1.0  # 19 tied for the last place behind 0..4
    weights, ids = moe_router.softmax_topk(wide[:, :20], 6, True)  # rows 24 apart
    assert ids.tolist() == [[3, 7, 11, 0, 1, 2], [0, 1, 2, 3, 4, 6]]
    close_weights(weights, reference(wide[:, :20].contiguous(), 6, True)[0])


def router(cls, dtype, device, seed=0, experts=20, top_k=3, hidden=48, normalize=True):
    config = types.SimpleNamespace(num_experts_per_tok=top_k, num_experts=experts, norm_topk_prob=normalize,
                                   hidden_size=hidden)  # fmt: skip
    module = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(experts, hidden, generator=g) / hidden**0.5)
    return module.to(device, dtype).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", ROUTERS)
@pytest.mark.parametrize("normalize", [True, False])
def test_installed_router_matches_transformers(on_cpu_too, monkeypatch, device, dtype, cls, normalize):
    fused, original = router(cls, dtype, device, normalize=normalize), router(cls, dtype, device, normalize=normalize)
    calls = []
    kernel, gemv_call = moe_router.softmax_topk, gemv.gemv
    monkeypatch.setattr(moe_router, "softmax_topk", lambda *a: calls.append("topk") or kernel(*a))
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append("gemv") or gemv_call(*a, **kw))
    assert moe_router.install(torch.nn.Sequential(fused)) == 1
    g = torch.Generator().manual_seed(7)
    for shape in ((1, 1, 48), (3, 48)):  # a decode step's token; three rows take F.linear for the logits
        hidden = torch.randn(shape, generator=g).to(device, dtype)
        got, want = fused(hidden), original(hidden)
        assert [t.shape for t in got] == [t.shape for t in want] and [t.dtype for t in got] == [t.dtype for t in want]
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # logits: gemv's sum order
        assert torch.equal(got[2], want[2])
        close_weights(got[1], want[1])
    assert calls == ["gemv", "topk", "topk"]


def test_install_swaps_routers_only_and_cpu_tensors_keep_transformers_forward(monkeypatch):
    thinker, talker = (router(cls, torch.float32, "cpu") for cls in ROUTERS)
    other = torch.nn.Linear(48, 20, bias=False)
    model = torch.nn.Sequential(thinker, other, torch.nn.Sequential(talker))
    assert moe_router.install(model) == 2
    assert thinker.forward.__func__ is talker.forward.__func__ is moe_router._router_forward
    assert "forward" not in vars(other)
    monkeypatch.setattr(moe_router, "softmax_topk", lambda *a: pytest.fail("fused path on a CPU tensor"))
    hidden = torch.randn(1, 48)
    for got, want in zip(thinker(hidden), type(thinker).forward(thinker, hidden)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_blocks_with_the_fused_router_match_transformers(on_cpu_too, device, stage, tokens):
    model = load_stage("dummy:tiny", stage, dtype=torch.float32).to(device)
    original = copy.deepcopy(model)
    assert moe_router.install(model) == len(model.model.layers)  # every tiny decoder layer is a MoE layer
    g = torch.Generator().manual_seed(tokens)
    for layer, ref in zip(model.model.layers, original.model.layers):
        hidden = torch.randn(1, tokens, layer.mlp.gate.hidden_dim, generator=g).to(device)
        got, want = layer.mlp(hidden), ref.mlp(hidden)
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_thinker_and_talker_with_fused_routers_match_generate(on_cpu_too, hf_model, processor, monkeypatch):
    """The stage runners with every router fused pick the experts generate() picks: same tokens, same codes."""
    from .test_stage_oracle import assert_runners_match_generate

    model = copy.deepcopy(hf_model)
    assert moe_router.install(model) > 0
    rows = []
    kernel = moe_router.softmax_topk
    monkeypatch.setattr(moe_router, "softmax_topk", lambda logits, *a: rows.append(len(logits)) or kernel(logits, *a))
    assert_runners_match_generate(model, hf_model, processor, thinker_slot=1, talker_slot=0)
    # prompts, the thinker's steps (slots 0..1: two rows) and the talker's (slot 0: one row, gemv's logits)
    assert {1, 2} < set(rows)
