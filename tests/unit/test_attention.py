# omni_sdpa: one-token grouped-query steps attend the cache in place and give sdpa's result; every other
# call is sdpa's own; load_stage switches only the decoder stacks of the thinker and the talker.
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from omnistage.models import attention
from omnistage.models.checkpoint import load_stage


class _Module:  # what sdpa reads of an attention module
    is_causal = True

    def __init__(self, groups: int = 1):
        self.num_key_value_groups = groups


def _inputs(batch, heads, kv_heads, q_len, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, 16, generator=g)
    k, v = (torch.randn(batch, kv_heads, kv_len, 16, generator=g) for _ in range(2))
    lengths = torch.randint(1, kv_len + 1, (batch,), generator=g)  # each row attends to its own prefix
    mask = (torch.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :].expand(batch, 1, q_len, kv_len)
    return q, k, v, mask


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (6, 3)])
def test_grouped_decode_step_matches_sdpa(heads, kv_heads):
    q, k, v, mask = _inputs(5, heads, kv_heads, 1, 37)
    module = _Module(heads // kv_heads)
    got, _ = attention.omni_sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (5, 1, heads, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a row that sees one position returns exactly that position's value, per query head
    one = mask.clone()
    one[0, ..., 1:] = False
    got, _ = attention.omni_sdpa_attention_forward(module, q, k, v, one, scaling=0.25)
    torch.testing.assert_close(got[0, 0], v[0, :, 0].repeat_interleave(heads // kv_heads, 0))


def test_other_calls_are_sdpa_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(a[1].shape[2]))
    q, k, v, mask = _inputs(2, 8, 2, 3, 9)
    attention.omni_sdpa_attention_forward(_Module(), q, k, v, mask)  # prefill: several query positions
    q1, k1, v1, mask1 = _inputs(2, 8, 8, 1, 9)
    attention.omni_sdpa_attention_forward(_Module(), q1, k1, v1, mask1)  # no grouping
    attention.omni_sdpa_attention_forward(_Module(), q1[:, :, :, :], k1[:, :2], v1[:, :2], None)  # no mask
    assert calls == [3, 1, 1]


DECODERS = {"Qwen3OmniMoeThinkerTextAttention", "Qwen3OmniMoeTalkerCodePredictorAttention"}


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_load_stage_switches_the_decoder_stacks_only(stage):
    def implementations(model):
        return {type(m).__name__: m.config._attn_implementation for m in model.modules()
                if type(m).__name__.endswith("Attention")}  # fmt: skip

    names = implementations(load_stage("dummy:tiny", stage, dtype=torch.float32))
    assert {n for n in names if n in DECODERS} == (DECODERS if stage == "talker" else DECODERS - {
        "Qwen3OmniMoeTalkerCodePredictorAttention"})
    assert all((impl == attention.NAME) == (n in DECODERS) for n, impl in names.items()), names  # encoders: sdpa
    pinned = implementations(load_stage("dummy:tiny", stage, dtype=torch.float32, attn_implementation="eager"))
    assert set(pinned.values()) == {"eager"}
