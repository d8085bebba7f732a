# Experts implementations registered with transformers' ExpertsInterface; GPU stages load gather_or_grouped.
#
# "lean_grouped_mm": transformers' grouped_mm computation (torch._grouped_mm over all experts' weights with
# per-expert offsets) without its expert-parallel sentinel handling, which costs three full passes of
# masked_fill, a clamp and an inverse permutation per layer. The same ops on the same values in the same
# order: the same output bit for bit. Where the fused kernels are installed (CUDA), three kernels of our own
# take the rest: the pairs in expert order (the stable sort's order, counted, in place of torch's sort, histc,
# cumsum and inverse permutation), silu(gate) * up (within a bf16 rounding of silu's exp), and the way back to
# the tokens (unsort, weighting, sum over k). On the H200 a thinker chunk prefill of 16 W1 suffixes spent ~13
# of its 43 ms of kernels in those elementwise passes (perf/results/h200-chunk-prefill-profiles.json); on an
# H100 the expert order took a thinker decode step of 64 rows from 19.7 to 17.7 ms of kernels, a talker frame
# of 64 rows from 6.3 to 5.5 ms and a thinker prefill of 16 W1 prompts from 59.2 to 56.3 ms
# (perf/results/h100-expert-order.json).
#
# "gather_or_grouped": for decode steps of any size. A step of one or two tokens needs only their top-k
# experts' weights. For few (token, expert) pairs the weights of exactly those pairs are gathered and
# multiplied in one bmm each (transformers' batched_mm, without its sentinel clamp, with the same fused
# epilogues); beyond GATHER_MAX_PAIRS lean_grouped_mm runs. The choice depends on shapes only, so each
# CUDA-graph bucket captures one path. On the H200 a lone talker frame (20 MoE layers, 6 of 128 experts of
# 2.4 MB each) went from 4.0 to 3.2 ms for its LM step: ~200 fewer kernels than grouped_mm's sort,
# histogram, scan and grouped-GEMM setup (perf/results/h200-lone-steps.json).
from __future__ import annotations

import torch
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    _batched_linear,
    _grouped_linear,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)

from . import fused_projections, gemv

NAME = "gather_or_grouped"
LEAN_NAME = "lean_grouped_mm"
# gather traffic ~ 3 x pairs x one expert's weights vs grouped_mm's fixed ~1.2 GB per layer (thinker):
# even at 16 pairs (2 tokens) the gather moves ~0.45 GB
GATHER_MAX_PAIRS = 16


def gather_or_grouped_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    pairs = hidden_states.shape[0] * top_k_index.shape[-1]
    forward = gathered_experts_forward if pairs <= GATHER_MAX_PAIRS else lean_grouped_mm_experts_forward
    return forward(self, hidden_states, top_k_index, top_k_weights)


def gathered_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A few (token, expert) pairs: each pair's weights read in place by gemv where the fused kernels are installed, else
    gathered and multiplied in one bmm as transformers' batched_mm does."""
    if self.has_bias or not self.has_gate:  # not Qwen3-Omni's experts: transformers' own path
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)  # pair (t, k) at row t * top_k + k; every id is a real expert
    if _fused_epilogues(self, hidden_states) and gemv.enabled and not self.is_transposed:
        # each pair reads its expert's weights where they are (no gathered copy): gemv.py
        gate_up = gemv.gemv(hidden_states, self.gate_up_proj, expert_ids, top_k)
        down = gemv.gemv(gate_up, self.down_proj, expert_ids, silu_mul=True)  # silu(gate) * up on the way in
        return _combine_pairs(down, top_k_weights, hidden_states.dtype)
    pairs = hidden_states.repeat_interleave(top_k, dim=0)
    gate_up = _batched_linear(pairs, self.gate_up_proj[expert_ids], is_transposed=self.is_transposed)
    fused = _fused_epilogues(self, gate_up)
    gated = fused_projections.silu_mul(gate_up) if fused else self._apply_gate(gate_up)
    down = _batched_linear(gated, self.down_proj[expert_ids], is_transposed=self.is_transposed)
    if fused:
        return _combine_pairs(down, top_k_weights, hidden_states.dtype)
    weighted = down * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _combine_pairs(down: torch.Tensor, top_k_weights: torch.Tensor, dtype) -> torch.Tensor:
    """The pairs' outputs [T * K, H], already in token order: the weighting and the sum over k in one kernel."""
    tokens, top_k = top_k_weights.shape
    positions = torch.arange(tokens * top_k, device=down.device).view(tokens, top_k)
    return fused_projections.combine_experts(down, positions, top_k_weights, dtype)


def _fused_epilogues(self: torch.nn.Module, gate_up: torch.Tensor) -> bool:
    """Whether silu(gate) * up and the way back run as Triton kernels: where the fused kernels are installed
    (fused_projections.install sets the flag) and the activation is silu."""
    return (getattr(self, "fused_epilogues", False) and fused_projections.fused_tensor(gate_up)
            and self.config.hidden_act == "silu")  # fmt: skip


def is_experts_module(module: torch.nn.Module) -> bool:
    """A MoE block's experts (thinker, talker): all experts' weights in one gate_up_proj / down_proj each."""
    return hasattr(module, "gate_up_proj") and hasattr(module, "num_experts")


def lean_grouped_mm_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    if self.has_bias or not self.has_gate:  # not Qwen3-Omni's experts: transformers' own path
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    if _fused_epilogues(self, hidden_states):  # the pairs in expert order, the gate and the way back: a kernel each
        offsets, rows, positions = fused_projections.expert_order(top_k_index, self.num_experts)
        gate_up = _grouped_linear(hidden_states[rows], self.gate_up_proj, offsets, is_transposed=self.is_transposed)
        down = _grouped_linear(fused_projections.silu_mul(gate_up), self.down_proj, offsets,
                               is_transposed=self.is_transposed)  # fmt: skip
        return fused_projections.combine_experts(down, positions, top_k_weights, hidden_states.dtype)
    # (token, expert) pairs sorted by expert; every expert id is a real one (no expert-parallel sentinels)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    # histc, not bincount: a fixed output size, so CUDA graphs can capture it (as in transformers)
    histc_input = expert_ids.int() if hidden_states.is_cuda else expert_ids.float()
    offsets = torch.cumsum(torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1),
                           dim=0, dtype=torch.int32)  # fmt: skip
    gate_up = _grouped_linear(hidden_states[perm // top_k], self.gate_up_proj, offsets,
                              is_transposed=self.is_transposed)  # fmt: skip
    down = _grouped_linear(self._apply_gate(gate_up), self.down_proj, offsets, is_transposed=self.is_transposed)
    # back to (token, k) order, then weighted and summed over k as transformers does (same promotion)
    unsorted = torch.empty_like(down)
    unsorted[perm] = down
    weighted = unsorted.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Makes our experts implementation names valid for every model built afterwards."""
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, gather_or_grouped_experts_forward)
    if LEAN_NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(LEAN_NAME, lean_grouped_mm_experts_forward)
