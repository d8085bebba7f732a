# A decoder stack's layers as transformers' decoder layers run them (input norm, attention, residual add,
# post-attention norm, MLP, residual add; the same for the thinker's, talker's and code predictor's
# layers), but with each residual add fused into the RMSNorm that follows it: the post-attention norm, the
# next layer's input norm, or the stack's final norm. Where the norms are fused_ops' kernels (CUDA),
# the add and the norm are one kernel that rounds as the two ops do; elsewhere the same
# two ops run. A lone talker frame (20 talker layers, 75 code-predictor layer passes) ran ~190 such adds
# at ~2-3 us each when the GPU was mostly idle between them (perf/results/2026-12-04-h200-lone-steps.json).
from __future__ import annotations

import torch

from . import fused_ops, fused_projections


def run_layers(layers, hidden: torch.Tensor, final_norm: torch.nn.Module | None = None, **attention_kwargs):
    """hidden [B, T, D] through every layer; returns final_norm(output), or without final_norm the output
    itself. attention_kwargs go to each layer's attention (attention_mask, position_embeddings,
    past_key_values), as the decoder layer passes them."""
    residual, normed = hidden, layers[0].input_layernorm(hidden)
    for i, layer in enumerate(layers):
        attended, _ = layer.self_attn(hidden_states=normed, **attention_kwargs)
        residual, normed = add_norm(residual, attended, layer.post_attention_layernorm)
        out = layer.mlp(normed)
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        if after is None:
            return residual + out
        residual, normed = add_norm(residual, out, after)
    return normed


def add_norm(residual: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, norm(residual + x)), in one kernel where the norm is a fused one."""
    same_layout = x.dtype == residual.dtype and x.shape == residual.shape
    if same_layout and fused_ops.is_fused_norm(norm) and fused_projections.fused_tensor(x):
        return fused_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    total = residual + x
    return total, norm(total)
