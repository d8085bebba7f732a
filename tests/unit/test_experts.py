# The gather_or_grouped experts implementation: the same MoE output as transformers' own per-expert loop,
# on both of its paths (few pairs: gathered bmm; many: grouped_mm), for thinker and talker experts.
import pytest
import torch

from omnistage.models import experts
from omnistage.models.checkpoint import load_stage


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


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
    monkeypatch.setattr(experts, "batched_mm_experts_forward", lambda *a: calls.append("gather"))
    monkeypatch.setattr(experts, "grouped_mm_experts_forward", lambda *a: calls.append("grouped"))
    for tokens in (1, experts.GATHER_MAX_PAIRS // 8, experts.GATHER_MAX_PAIRS // 8 + 1):
        experts.gather_or_grouped_experts_forward(None, torch.zeros(tokens, 4), torch.zeros(tokens, 8), None)
    assert calls == ["gather", "gather", "grouped"]
