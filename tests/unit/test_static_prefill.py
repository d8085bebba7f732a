# The static prefill: prompts of different lengths prefilled together, padded to a (rows, tokens) bucket,
# leave in each slot's blocks the K/V and return the last hidden state that each prompt gets when
# prefilled alone, and touch no other block (the null block aside: padded positions land there).
import torch

from omnistage.models.checkpoint import load_stage
from omnistage.core.block_pool import BLOCK
from omnistage.stages.paged_kv import PagedKVCache
from omnistage.stages.static_prefill import StaticPrefill, token_buckets

from .test_stage_oracle import slot_kv


def _prefill(text_model, lengths, slots, buckets=None):
    cfg = text_model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 6, cfg.num_key_value_heads, cfg.head_dim, num_blocks=64, max_len=128,
                         dtype=torch.float32, device="cpu")  # fmt: skip
    cache.k_all.fill_(7.0)  # what was there before
    cache.v_all.fill_(7.0)
    prefill = StaticPrefill("test", text_model, cache, max_rows=4, max_tokens=128, cuda_graphs=False)
    if buckets:
        prefill.row_buckets, prefill.token_buckets = buckets
    g = torch.Generator().manual_seed(0)
    embeds = [torch.randn(n, cfg.hidden_size, generator=g) * 0.1 for n in (13, 29)]
    hidden = prefill.run([embeds[i] for i in lengths], slots).clone()
    return hidden, cache


@torch.inference_mode()
def test_batched_padded_prefill_equals_each_prompt_alone():
    text_model = load_stage("dummy:tiny", "talker", dtype=torch.float32, seed=3).model
    together, cache = _prefill(text_model, [0, 1], [4, 1], buckets=([4], [64, 128]))  # 2 rows as 4, 29 as 64
    for i, (slot, n) in enumerate([(4, 13), (1, 29)]):
        alone, own = _prefill(text_model, [i], [slot])
        torch.testing.assert_close(together[i], alone[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(slot_kv(cache, slot, n), slot_kv(own, slot, n), rtol=1e-5, atol=1e-6)
    held = [b for table in cache.pool.tables for b in table]
    assert sorted(held) == list(range(1, 4))  # 1 + 2 blocks for 13 and 29 tokens
    for k in (cache.k_all, cache.v_all):  # every other block but the null one untouched
        assert (k[:, (max(held) + 1) * BLOCK :] == 7.0).all()


def test_token_buckets():
    assert token_buckets(512) == [64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [64, 100]
