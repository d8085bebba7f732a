"""KV budget: how many slots a thinker or talker instance gets (omnistage/stages/kv_budget.py)."""

import json
from pathlib import Path

import pytest
import torch

from omnistage.models.checkpoint import load_config
from omnistage.stages.kv_budget import kv_budget_bytes, kv_bytes_per_slot, plan_slots
from omnistage.stages.kv_cache import SlotKVCache

REAL_CONFIG = Path(__file__).resolve().parents[2] / "perf" / "qwen3_omni_30b_a3b_instruct.config.json"


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_slot_is_what_the_cache_allocates(tiny_checkpoint, stage, dtype):
    text = getattr(load_config(tiny_checkpoint), f"{stage}_config").text_config
    cache = SlotKVCache(text.num_hidden_layers, 3, text.num_key_value_heads, 40, text.head_dim, dtype, "cpu")
    allocated = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert kv_bytes_per_slot(text, 40, dtype) * 3 == allocated


def test_full_size_thinker_slot():
    """The released model: 48 layers x 4 KV heads x 128 dims, K and V in bf16, 4096 tokens: 384 MiB."""
    text = type("Text", (), json.loads(REAL_CONFIG.read_text())["thinker_config"]["text_config"])
    assert kv_bytes_per_slot(text, 4096, torch.bfloat16) == 2 * 48 * 4 * 128 * 4096 * 2


def test_plan_keeps_max_batch_size_without_a_budget():
    plan = plan_slots(64, 1000, None)
    assert (plan.slots, plan.cache_bytes, plan.budget_bytes) == (64, 64_000, None)


def test_plan_shrinks_to_what_the_budget_holds():
    assert plan_slots(64, 1000, 10_999).slots == 10
    assert plan_slots(8, 1000, 10_999).slots == 8  # a budget never adds slots
    assert plan_slots(64, 1000, 10_999).cache_bytes == 10_000


def test_a_budget_without_room_for_one_slot_is_refused():
    with pytest.raises(ValueError, match="holds no slot"):
        plan_slots(8, 1000, 999)


def test_budget_from_parameters():
    assert kv_budget_bytes({}) is None
    assert kv_budget_bytes({"kv_cache_bytes": "123456"}) == 123456
