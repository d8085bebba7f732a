# What every stage installs on CUDA, in one call for any stage's model: the fused elementwise
# kernels (RMSNorm, rotary, SnakeBeta: fused_ops), the merged q/k/v and gate/up projections of the decoder
# stacks (fused_projections), the MoE routers' softmax + top-k as one kernel (moe_router) and Code2Wav's
# copy-free convolutions (code2wav_convs). Each part swaps only the module classes it knows, so a stage's
# model gets the parts that apply to it.
from __future__ import annotations

import torch

from . import code2wav_convs, fused_ops, fused_projections, moe_router


def install(model: torch.nn.Module) -> dict[str, int]:
    """Installs every part on `model` (on its device already); returns how many modules each swapped."""
    return {"fused_ops": fused_ops.install(model), "merged_projections": fused_projections.install(model),
            "fused_routers": moe_router.install(model), "copy_free_convs": code2wav_convs.install(model)}  # fmt: skip
