# An experts implementation for decode steps of any size, registered with transformers' ExpertsInterface
# as "gather_or_grouped". transformers' grouped_mm (torch._grouped_mm) takes the whole [experts, ...] weight
# tensors and their offsets; a step of one or two tokens needs only their top-k experts' weights. For few
# (token, expert) pairs the weights of exactly those pairs are gathered and multiplied in one bmm
# (transformers' batched_mm); beyond GATHER_MAX_PAIRS the gather would copy more than grouped_mm reads, so
# grouped_mm runs. Which is faster at 1-2 tokens is for perf/stage_timing.py --experts to show on the GPU.
# The choice depends on shapes only, so each CUDA-graph bucket captures one path.
from __future__ import annotations

import torch
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)

NAME = "gather_or_grouped"
# gather traffic ~ 3 x pairs x one expert's weights vs grouped_mm's fixed ~1.2 GB per layer (thinker):
# even at 16 pairs (2 tokens) the gather moves ~0.45 GB
GATHER_MAX_PAIRS = 16


def gather_or_grouped_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    pairs = hidden_states.shape[0] * top_k_index.shape[-1]
    forward = batched_mm_experts_forward if pairs <= GATHER_MAX_PAIRS else grouped_mm_experts_forward
    return forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Makes `experts_implementation="gather_or_grouped"` valid for every model built afterwards."""
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, gather_or_grouped_experts_forward)
