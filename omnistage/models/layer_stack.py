# A decoder stack's layers as transformers' decoder layers run them (input norm, attention, residual add,
# post-attention norm, MLP, residual add; the same for the thinker's, talker's and code predictor's
# layers), but with each residual add fused into the RMSNorm that follows it: the post-attention norm, the
# next layer's input norm, or the stack's final norm. Where the norms are fused_ops' kernels (CUDA),
# the add and the norm are one kernel that rounds as the two ops do; elsewhere the same
# two ops run. A lone talker frame (20 talker layers, 75 code-predictor layer passes) ran ~190 such adds
# at ~2-3 us each when the GPU was mostly idle between them (perf/results/h200-lone-steps.json).
from __future__ import annotations

import torch

from . import fused_ops, fused_projections


def run_layers(layers, hidden: torch.Tensor, final_norm: torch.nn.Module | None = None, **attention_kwargs):
    """hidden [B, T, D] through every layer; returns final_norm(output), or without final_norm the output
    itself. attention_kwargs go to each layer's attention (attention_mask, position_embeddings,
    past_key_values), as the decoder layer passes them."""
    return _stack(layers, hidden, final_norm, lambda layer, x: layer.self_attn(hidden_states=x, **attention_kwargs)[0])


def _stack(layers, hidden: torch.Tensor, final_norm, attend):
    """The layer loop of run_layers and run_joint; attend(layer, normed) is a layer's attention output."""
    residual, normed = hidden, layers[0].input_layernorm(hidden)
    for i, layer in enumerate(layers):
        residual, normed = add_norm(residual, attend(layer, normed), layer.post_attention_layernorm)
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


def run_joint(layers, parts: list[tuple[torch.Tensor, dict]], final_norm: torch.nn.Module | None = None
              ) -> torch.Tensor:  # fmt: skip
    """Several batches of tokens through the layers in one forward: each part (hidden [B_i, T_i, D], its
    attention_kwargs) attends on its own (its rows, positions, cache writer), while the norms and the MLP
    run once over every part's tokens. A MoE layer then reads its experts' weights once for all of them:
    the thinker's experts are ~1.2 GB a layer, of which a forward of many tokens reads nearly all (64
    decode rows: 12 ms of an H200 for 48 layers), so a decode step and a long prompt's piece in one
    forward save a second such read a step. Returns the parts' outputs flat, [sum B_i * T_i, D] in part
    order, as run_layers returns one part's (normed with final_norm, else the last layer's output)."""
    if len(parts) == 1:
        hidden, kwargs = parts[0]
        return run_layers(layers, hidden, final_norm, **kwargs).flatten(0, 1)
    shapes = [h.shape[:2] for h, _ in parts]
    sizes = [b * t for b, t in shapes]

    def attend(layer, normed: torch.Tensor) -> torch.Tensor:  # each part's rows through its own attention
        return torch.cat([layer.self_attn(hidden_states=x.view(*shape, -1), **kwargs)[0].flatten(0, 1)
                          for x, shape, (_, kwargs) in zip(normed[0].split(sizes), shapes, parts)])[None]  # fmt: skip

    flat = torch.cat([h.flatten(0, 1) for h, _ in parts])[None]  # [1, N, D]
    return _stack(layers, flat, final_norm, attend)[0]
