# The MoE router of a decode step in two kernels: the logits through gemv's one-row GEMV, then softmax,
# top-k and the renormalisation of the picked probabilities as one Triton kernel. Transformers' router
# (Qwen3OmniMoe{Thinker,Talker}TextTopKRouter) runs 9 at one token: a cuBLAS GEMM, a cast, softmax, topk's
# gatherTopK and bitonicSort, sum, a copy, div and the cast back. Those kernels are bound by their launches,
# not their work: ~20 us per layer in a CUDA graph on the H200 (these two: ~4.4 us), for 48 thinker and 20
# talker layers a step.
#
# The kernel computes what transformers does, in float32 as softmax(dtype=torch.float): exp(x - max) over
# the sum of those (libdevice's exp, as torch's expf; IEEE division, not Triton's approximate one), the k
# largest probabilities in descending order (ties to the lower expert index), each divided by their sum
# when norm_topk_prob, rounded once to the logits' dtype (to nearest even). Only the order of the two
# float32 sums differs from torch's.
#
# install(model) swaps the forward of the thinker's and talker's routers; CPU tensors keep transformers'.
from __future__ import annotations

import types

import torch

from . import fused_ops, fused_projections, gemv

if fused_ops.available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .fused_ops import _cast

ROUTER_CLASSES = ("Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter")

if fused_ops.available():

    @triton.jit
    def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, s_row, TOP_K: tl.constexpr,
                             K_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK: tl.constexpr,
                             LIBDEVICE: tl.constexpr):  # fmt: skip
        # one program per row: logits [rows, E] (contiguous E), w and ids [rows, TOP_K] contiguous;
        # BLOCK = E padded to a power of two, K_BLOCK = TOP_K padded likewise
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        keep = e < n_experts
        x = tl.load(logits_ptr + row * s_row + e, mask=keep, other=float("-inf")).to(tl.float32)
        shifted = x - tl.max(x, axis=0)
        p = libdevice.exp(shifted) if LIBDEVICE else tl.exp(shifted)  # padding: exp(-inf) = 0
        p = tl.div_rn(p, tl.broadcast_to(tl.sum(p, axis=0), [BLOCK]))
        # k rounds of (max, lowest index holding it, mask it out); padding at -1 is never picked
        left = tl.where(keep, p, -1.0)
        j = tl.arange(0, K_BLOCK)
        values = tl.zeros([K_BLOCK], dtype=tl.float32)
        ids = tl.zeros([K_BLOCK], dtype=tl.int64)
        total = 0.0
        for k in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == best, e, BLOCK), axis=0)
            values = tl.where(j == k, best, values)
            ids = tl.where(j == k, pick.to(tl.int64), ids)
            total += best  # in k order
            left = tl.where(e == pick, -1.0, left)
        if NORMALIZE:
            values = tl.div_rn(values, tl.broadcast_to(total, [K_BLOCK]))
        out = row * TOP_K + j
        tl.store(w_ptr + out, _cast(values, w_ptr.dtype.element_ty), mask=j < TOP_K)
        tl.store(ids_ptr + out, ids, mask=j < TOP_K)


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, E] -> (weights [rows, top_k] in logits' dtype, expert ids [rows, top_k] int64): the top_k
    of softmax(logits, float32), descending, renormalised to sum 1 when normalize, in one kernel."""
    rows, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(rows, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
    _softmax_topk_kernel[(rows,)](
        logits, weights, ids, n, logits.stride(0), TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k),
        NORMALIZE=bool(normalize), BLOCK=triton.next_power_of_2(n), LIBDEVICE=fused_ops.has_libdevice(),
        num_warps=1)  # fmt: skip
    return weights, ids


def _router_forward(self, hidden_states: torch.Tensor):
    if not fused_projections.fused_tensor(hidden_states):
        return type(self).forward(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = gemv.linear(hidden_states, self.weight)  # [rows, E]; more rows than one: F.linear
    weights, ids = softmax_topk(router_logits, self.top_k, self.norm_topk_prob)
    return router_logits, weights, ids


def install(model: torch.nn.Module) -> int:
    """The fused router forward on the thinker's and talker's MoE routers; returns how many were swapped
    (0 without triton)."""
    if not enabled:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in ROUTER_CLASSES:
            module.forward = types.MethodType(_router_forward, module)
            swapped += 1
    return swapped


enabled = fused_ops.available()
