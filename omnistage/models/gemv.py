# One-row matmuls (a lone request's decode step) as one Triton kernel that streams the weight once. cuBLAS
# runs them as GEMMs tiled for many rows: on the H200 a lone talker frame's 336 such projections ran at
# ~1-1.6 TB/s, two thirds of the frame's kernel time (perf/results/h200-lone-steps.json). With
# expert ids, each row reads its own expert's weight in place, where the gathered path
# (experts.py) first copies the picked experts' weights and then multiplies them.
#
# Each program computes BLOCK_N outputs of one row, summing over K in float32 and rounding once to the
# output dtype (to nearest even, as fused_ops' kernels do): the same as a GEMM up to the order of the sum.
from __future__ import annotations


import torch

from . import fused_ops

if fused_ops.available():
    import triton
    import triton.language as tl

    from .fused_ops import _cast, _silu_times

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, sx_m, sw_e, sw_n, ROWS_PER_X: tl.constexpr,
                     HAS_IDS: tl.constexpr, SILU_MUL: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
        # out[m, n] = sum_k x[m // ROWS_PER_X, k] * w[(ids[m],) n, k]; weights with a contiguous K. SILU_MUL:
        # x rows hold (gate, up), 2K wide, and x[k] = silu(gate[k]) * up[k], rounded as silu_mul's kernel
        m = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep_n = n < N
        w_base = w_ptr
        if HAS_IDS:
            w_base += tl.load(ids_ptr + m).to(tl.int64) * sw_e
        x_row = x_ptr + (m // ROWS_PER_X) * sx_m
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            keep_k = k < K
            x = tl.load(x_row + k, mask=keep_k, other=0.0).to(tl.float32)
            if SILU_MUL:
                up = tl.load(x_row + K + k, mask=keep_k, other=0.0).to(tl.float32)
                x = _silu_times(x, up, x_ptr.dtype.element_ty, LIBDEVICE)
            w = tl.load(w_base + n[:, None] * sw_n + k[None, :], mask=keep_n[:, None] & keep_k[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + m * N + n, _cast(out, out_ptr.dtype.element_ty), mask=keep_n)


MAX_ROWS = 1  # 2 rows of the code predictor's gate/up ran at 0.83x cuBLAS's speed on the H200 (1 row: 1.2x)
PROGRAMS = 512  # programs per call the block size aims at: ~4 per SM of an H100/H200 keep loads in flight
NUM_WARPS = 4
MIN_BLOCK_N = 4


def gemv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None = None, rows_per_x: int = 1, *,
         silu_mul: bool = False, programs: int | None = None, num_warps: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [R, K] times weight [N, K] transposed -> [R, N] (F.linear without bias), or with expert ids [M]
    and weight [E, N, K]: row m = x[m // rows_per_x] times weight[ids[m]] transposed -> [M, N].
    silu_mul: x is [R, 2K] (gate, up) and stands for silu(gate) * up, one kernel less per MLP.
    programs / num_warps: tuning (perf/gemv_bench.py), PROGRAMS and NUM_WARPS by default."""
    rows = x.shape[0] * rows_per_x if ids is None else ids.shape[0]
    n, k = weight.shape[-2:]
    assert weight.stride(-1) == 1 and x.shape[-1] == k * (2 if silu_mul else 1)
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    # the widest block of outputs that still gives PROGRAMS programs, then ~4096 weights per loop step;
    # Triton's CPU interpreter (tests) runs one program at a time, so there: few, wide ones
    per_program = max(1, rows * n // (programs or PROGRAMS)) if x.is_cuda else n
    block_n = max(MIN_BLOCK_N, min(64, 1 << (per_program.bit_length() - 1)))
    block_k = max(32, min(4096 // block_n, triton.next_power_of_2(k)))
    _gemv_kernel[(rows, triton.cdiv(n, block_n))](
        x, weight, ids if ids is not None else x, out, n, k, x.stride(0), weight.stride(0) if ids is not None else 0,
        weight.stride(-2), ROWS_PER_X=rows_per_x, HAS_IDS=ids is not None, SILU_MUL=silu_mul,
        LIBDEVICE=fused_ops.has_libdevice(), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps or NUM_WARPS)  # fmt: skip
    return out


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether linear() runs x [..., K] through gemv: at most MAX_ROWS rows, no bias, the kernel on."""
    return bias is None and x.numel() // x.shape[-1] <= MAX_ROWS and enabled and weight.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv for at most MAX_ROWS rows of a CUDA (or, in tests, interpreted) input."""
    if not takes(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    return gemv(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


enabled = fused_ops.available()  # installed with the other fused kernels (models/fused.py)
