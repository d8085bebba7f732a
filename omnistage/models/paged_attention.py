# Decode attention over a paged KV cache (stages/paged_kv.py), on CUDA: each row reads its own blocks up to
# its own length, so one long context beside many short ones costs only its own reads (a gathered batch
# would read every row to the longest row's length). Split-K like flash-decoding: program (row, KV head,
# part) runs an online softmax over 1/PARTS of the row's positions for the G query heads that share the
# KV head (one [G, D] x [D, TILE] product per tile: grouped-query attention reads each K/V tile once); a
# second kernel merges the parts. The parts keep a 30,000-token row from being one program's serial walk
# while the short rows' programs beside it have long finished. Grids and loops depend on no host value, so
# the decode step stays one CUDA graph per rows bucket whatever the rows' lengths.
from __future__ import annotations

import torch

from . import fused_ops

PARTS = 32  # programs per (row, KV head); a row shorter than PARTS * TILE positions uses fewer
TILE = 64  # positions per inner step (4 blocks of 16)

if fused_ops.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _part_len(length, PARTS: tl.constexpr, TILE: tl.constexpr):
        return tl.cdiv(tl.cdiv(length, PARTS), TILE) * TILE

    @triton.jit
    def _decode_parts_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale, max_blocks,
                             s_p, s_h, heads, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                             BLOCK: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
        # q [B, heads, D] contiguous; k, v pools [P, Hk, D] (strides s_p, s_h, 1); table [slots, max_blocks];
        # out: per (row, KV head, part) the running max m, sum l [GP] and unnormalised acc [GP, D] in fp32
        b, h, p = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
        heads_k = tl.num_programs(1)
        length = tl.load(len_ptr + b).to(tl.int32)
        part = _part_len(length, PARTS, TILE)
        start = p * part
        end = tl.minimum(start + part, length)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(q_ptr + (b * heads + h * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(start, end, TILE):
            tok = t0 + tl.arange(0, TILE)
            valid = tok < end
            block = tl.load(table_ptr + b * max_blocks + tok // BLOCK, mask=valid, other=0).to(tl.int64)
            rows = (block * BLOCK + tok % BLOCK)[:, None] * s_p + h * s_h + d[None, :]
            k = tl.load(k_ptr + rows, mask=valid[:, None], other=0.0)  # [TILE, D]
            s = tl.dot(q, tl.trans(k)) * scale  # [GP, TILE]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            weights = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(weights, 1)
            v = tl.load(v_ptr + rows, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
            m = m_new
        if start < length:  # parts past the row's length are never merged: no writes for them
            at = (b * heads_k + h) * PARTS + p
            tl.store(m_ptr + at * GP + g, m)
            tl.store(l_ptr + at * GP + g, l)
            tl.store(acc_ptr + (at * GP + g)[:, None] * D + d[None, :], acc)

    @triton.jit
    def _merge_parts_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, out_ptr, heads, G: tl.constexpr, GP: tl.constexpr,
                            D: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
        # out [B, 1, heads, D] contiguous, in the query's dtype
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        heads_k = tl.num_programs(1)
        length = tl.load(len_ptr + b).to(tl.int32)
        used = tl.cdiv(length, _part_len(length, PARTS, TILE))
        g, d = tl.arange(0, GP), tl.arange(0, D)
        m_all = tl.full([GP], float("-inf"), tl.float32)
        l_all = tl.zeros([GP], tl.float32)
        acc_all = tl.zeros([GP, D], tl.float32)
        for p in range(0, used):
            at = (b * heads_k + h) * PARTS + p
            m = tl.load(m_ptr + at * GP + g)
            m_new = tl.maximum(m_all, m)
            mine, theirs = tl.exp(m_all - m_new), tl.exp(m - m_new)
            l_all = l_all * mine + tl.load(l_ptr + at * GP + g) * theirs
            acc = tl.load(acc_ptr + (at * GP + g)[:, None] * D + d[None, :])
            acc_all = acc_all * mine[:, None] + acc * theirs[:, None]
            m_all = m_new
        out = acc_all / l_all[:, None]
        where = out_ptr + (b * heads + h * G + g)[:, None] * D + d[None, :]
        tl.store(where, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


def runs_on(query: torch.Tensor) -> bool:
    """Whether decode() takes this step: CUDA tensors with triton installed (tests point it at the CPU under
    Triton's interpreter by calling decode() directly)."""
    return query.is_cuda and fused_ops.available()


def decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
           lengths: torch.Tensor, scaling: float) -> torch.Tensor:  # fmt: skip
    """query [B, H, 1, D]; k_pool, v_pool [P, Hk, D] with P = blocks * BLOCK; table [>= B, max_blocks] int32
    (row b is slot b); lengths [B] long: row b attends to its positions [0, lengths[b]). -> [B, 1, H, D]."""
    from ..core.block_pool import BLOCK

    batch, heads, _, dim = query.shape
    heads_k = k_pool.shape[1]
    group = heads // heads_k
    gp = max(16, triton.next_power_of_2(group))  # tl.dot wants at least 16 rows
    q = query.reshape(batch, heads, dim).contiguous()
    m = torch.empty(batch, heads_k, PARTS, gp, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, heads_k, PARTS, gp, dim, dtype=torch.float32, device=query.device)
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    _decode_parts_kernel[(batch, heads_k, PARTS)](
        q, k_pool, v_pool, table, lengths, m, l, acc, scaling, table.shape[1], k_pool.stride(0), k_pool.stride(1),
        heads, G=group, GP=gp, D=dim, BLOCK=BLOCK, PARTS=PARTS, TILE=TILE)  # fmt: skip
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    _merge_parts_kernel[(batch, heads_k)](m, l, acc, lengths, out, heads, G=group, GP=gp, D=dim, PARTS=PARTS,
                                          TILE=TILE)  # fmt: skip
    return out
