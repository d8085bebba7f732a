# "omni_sdpa": transformers' sdpa attention, except for grouped-query decode steps with a mask.
# With a mask, transformers' sdpa path cannot use SDPA's enable_gqa and copies K and V once per query head
# (repeat_kv): x8 of the whole attended cache per layer for the thinker (32 query / 4 KV heads), which on
# the H200 cost 8 of the 35 ms of a 64-row decode step (perf/results/h200-static-prefill.json). A one-token
# step needs no copy: the G query heads that share a KV head are G queries of that head, all with the same
# mask, so one SDPA call over the KV heads computes exactly the same attention from the cache in place.
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "omni_sdpa"


def omni_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, **kwargs):  # fmt: skip
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or attention_mask is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    # query head h reads KV head h // G (repeat_kv's order), so [B, H, 1, D] -> [B, H_kv, G, D]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    mask = attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, 1, L]: broadcast over the G queries
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, head_dim).transpose(1, 2), None  # [B, 1, H, D] like sdpa's


def register() -> None:
    """Makes `omni_sdpa` a valid attention implementation (with sdpa's masks) for models built afterwards."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, omni_sdpa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_for_text_decoders(model: torch.nn.Module) -> None:
    """Switches the decoder stacks of a thinker or talker module (and the code predictor) that run sdpa to
    omni_sdpa. Encoders keep their own implementation: they never run one-token steps."""
    register()
    configs = [getattr(model.config, "text_config", None)]
    predictor = getattr(model, "code_predictor", None)
    if predictor is not None:
        configs.append(predictor.config)
    for config in configs:
        if config is not None and config._attn_implementation == "sdpa":
            config._attn_implementation = NAME
