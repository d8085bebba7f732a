# The paged KV pool's size: the budget over one block's bytes (plus the null block), without a budget as
# many blocks as max_batch_size sequences of max_seq_len take; a budget that cannot hold one sequence of
# max_seq_len is refused at load.
import json
from pathlib import Path

import pytest
import torch

from omnistage.core.block_pool import BLOCK
from omnistage.models.checkpoint import load_config
from omnistage.stages.kv_budget import kv_budget_bytes, kv_bytes_per_token, plan_pool
from omnistage.stages.paged_kv import PagedKVCache

REAL_CONFIG = Path(__file__).resolve().parents[2] / "perf" / "qwen3_omni_30b_a3b_instruct.config.json"


def test_the_plan_is_what_the_pool_allocates(tiny_checkpoint):
    text = load_config(tiny_checkpoint).thinker_config.text_config
    plan = plan_pool(text, torch.float32, 3, 40, 50 * kv_bytes_per_token(text, torch.float32) * BLOCK + 5)
    assert plan.blocks == 51 and plan.tokens == 50 * BLOCK
    cache = PagedKVCache(text.num_hidden_layers, 3, text.num_key_value_heads, text.head_dim, num_blocks=plan.blocks,
                         max_len=40, dtype=torch.float32, device="cpu")  # fmt: skip
    assert cache.bytes == plan.cache_bytes and cache.block_bytes == plan.block_bytes


def test_full_size_thinker_bytes_per_token():
    """The released model: 48 layers x 4 KV heads x 128 dims, K and V in bf16: 96 KiB a token."""
    text = type("Text", (), json.loads(REAL_CONFIG.read_text())["thinker_config"]["text_config"])
    assert kv_bytes_per_token(text, torch.bfloat16) == 2 * 48 * 4 * 128 * 2


def test_without_a_budget_every_slot_holds_max_seq_len(tiny_checkpoint):
    text = load_config(tiny_checkpoint).talker_config.text_config
    plan = plan_pool(text, torch.float32, 8, 1000, None)
    assert plan.tokens == 8 * 63 * BLOCK and plan.budget_bytes is None  # 1000 tokens take 63 blocks


def test_a_budget_below_one_sequence_is_refused(tiny_checkpoint):
    text = load_config(tiny_checkpoint).talker_config.text_config
    with pytest.raises(ValueError, match="max_seq_len"):
        plan_pool(text, torch.float32, 8, 1024, 64 * kv_bytes_per_token(text, torch.float32) * BLOCK)  # 1025 take 65


def test_budget_parameter():
    assert kv_budget_bytes({}) is None and kv_budget_bytes({"kv_cache_bytes": ""}) is None
    assert kv_budget_bytes({"kv_cache_bytes": "123456"}) == 123456
