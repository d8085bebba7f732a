# One batched decode step through a stack of transformers decoder layers over a PagedKVCache. Shared by
# the thinker and the talker: both use the same attention (q/k norm, interleaved MRoPE) and only
# differ in how the input row is embedded and what head reads the output.
from __future__ import annotations

import torch

from ..models.layer_stack import run_layers
from ..core.block_pool import BLOCK, blocks_for
from .paged_kv import PagedKVCache


def decode_step(
    text_model,  # Qwen3OmniMoeThinkerTextModel or Qwen3OmniMoeTalkerModel: .layers, .norm, .rotary_emb
    cache: PagedKVCache,  # row r of the step is slot r
    inputs_embeds: torch.Tensor,  # [rows, 1, D]
    positions: torch.Tensor,  # [rows] long: cache index the new token is written at
    rope_deltas: torch.Tensor,  # [rows] long: MRoPE offset of each row (0 for text-only prompts)
    kv_len: int,  # positions a gathered attention reads (> every row's position); a host int, so no device sync
) -> torch.Tensor:
    kwargs = decode_kwargs(text_model, cache, inputs_embeds, positions, rope_deltas, kv_len)
    hidden = run_layers(text_model.layers, inputs_embeds, text_model.norm, **kwargs)
    return hidden[:, 0]  # [rows, D]


def decode_kwargs(text_model, cache: PagedKVCache, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                  rope_deltas: torch.Tensor, kv_len: int) -> dict:  # fmt: skip
    """The attention kwargs of a decode step's layers (decode_step's arguments)."""
    rows = inputs_embeds.shape[0]
    kv_len = blocks_for(kv_len) * BLOCK  # a gather reads whole blocks
    # [rows, 1, 1, kv_len]: each row attends to its own prefix and the new token (the paged kernel, where it
    # runs, reads each row's length instead)
    mask = (torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None])[:, None, None, :]
    # decode tokens sit on the text diagonal of MRoPE: all three sections share one position
    rope_positions = (positions + rope_deltas).view(1, rows, 1).expand(3, rows, 1)
    position_embeddings = text_model.rotary_emb(inputs_embeds, rope_positions)
    step_cache = cache.step_view(rows, positions, kv_len, mask)
    return dict(attention_mask=mask, position_embeddings=position_embeddings, past_key_values=step_cache)
