# Decode attention over a paged KV cache (stages/paged_kv.py), on CUDA: each row reads its own blocks up to
# its own length, so one long context beside many short ones costs only its own reads (a gathered batch
# would read every row to the longest row's length). Split-K like flash-decoding: program (row, KV head,
# part) runs an online softmax over 1/PARTS of the row's positions for the G query heads that share the
# KV head (one [G, D] x [D, TILE] product per tile: grouped-query attention reads each K/V tile once); a
# second kernel merges the parts. The parts keep a 30,000-token row from being one program's serial walk
# while the short rows' programs beside it have long finished. Grids and loops depend on no host value, so
# the decode step stays one CUDA graph per rows bucket whatever the rows' lengths.
# Chunked prefill (prefill()) reads through the same tables: program (row, KV head, query tile) runs an online
# softmax for BQ of the row's new tokens times the G query heads of one KV head, over the row's positions up to
# its tile's last token, causally. Gathering instead copied every attended position of every row out of the
# pool per layer, and transformers' masked SDPA copied them again per query head: a 512-token piece of a
# 30,000-token prompt took ~1 GB of copies a layer, and steps with long prompts' pieces ran for seconds.
# A prefill grid too small to fill the GPU (a long prompt's lone piece: 512 tokens are 128 programs of the
# thinker, each walking all 30,000 positions) is split over the positions as decode is, into parts merged
# by a second kernel (prefill_parts()): a program's walk, not the number of programs, sets such a step's time.
from __future__ import annotations

import functools

import torch

from . import fused_ops

PARTS = 32  # programs per (row, KV head); a row shorter than PARTS * MIN_PART positions uses fewer
TILE = 64  # positions per inner step (4 blocks of 16)
# Positions a part walks at least: a short row (a W1 prompt and reply) is one program's walk, not three parts
# to merge. On an H100 a thinker step's attention over 64 W1 rows took 0.63-0.67 against 0.77 ms, over 32 W2
# rows 4.02 against 4.44 ms, a talker step's over 32 W2 rows 0.96 against 1.09 ms, with parts of at least a
# tile (perf/results/h100-paged-decode-parts.json).
MIN_PART = 256

if fused_ops.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _attend(q, k_ptr, v_ptr, table_row, h, s_p, s_h, lo, end, pos, scale, R: tl.constexpr, D: tl.constexpr,
                BLOCK: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
        """Online softmax of queries q [R, D] over positions [lo, end) of one sequence's blocks (table_row:
        its row of the block table), KV head h; query i sees positions up to pos[i]. -> running max m [R],
        sum l [R] and unnormalised acc [R, D], in fp32."""
        d = tl.arange(0, D)
        m = tl.full([R], float("-inf"), tl.float32)
        l = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, D], tl.float32)
        for t0 in range(lo, end, TILE):
            tok = t0 + tl.arange(0, TILE)
            valid = tok < end
            block = tl.load(table_row + tok // BLOCK, mask=valid, other=0).to(tl.int64)
            rows = (block * BLOCK + tok % BLOCK)[:, None] * s_p + h * s_h + d[None, :]
            k = tl.load(k_ptr + rows, mask=valid[:, None], other=0.0)  # [TILE, D]
            s = tl.dot(q, tl.trans(k)) * scale  # [R, TILE]
            s = tl.where(valid[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = _finite(m_new)
            alpha = tl.exp(m - m_safe)
            weights = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(weights, 1)
            v = tl.load(v_ptr + rows, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
            m = m_new
        return m, l, acc

    @triton.jit
    def _finite(m):
        """The running max to subtract: 0 where it is still -inf (a query that saw none of the positions so
        far, as a prefill part before its position leaves it, or a merged part that saw nothing), so that
        such weights come out 0, not NaN."""
        return tl.where(m == float("-inf"), 0.0, m)

    @triton.jit
    def _part_len(length, PARTS: tl.constexpr, TILE: tl.constexpr, MIN_PART: tl.constexpr):
        return tl.maximum(tl.cdiv(tl.cdiv(length, PARTS), TILE) * TILE, MIN_PART)

    @triton.jit
    def _decode_parts_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale, max_blocks,
                             s_p, s_h, heads, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                             BLOCK: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                             MIN_PART: tl.constexpr):  # fmt: skip
        # q [B, heads, D] contiguous; k, v pools [P, Hk, D] (strides s_p, s_h, 1); table [slots, max_blocks];
        # out: per (row, KV head, part) the running max m, sum l [GP] and unnormalised acc [GP, D] in fp32
        b, h, p = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
        heads_k = tl.num_programs(1)
        length = tl.load(len_ptr + b).to(tl.int32)
        part = _part_len(length, PARTS, TILE, MIN_PART)
        start = p * part
        if start < length:  # parts past the row's length read nothing and are never merged
            end = tl.minimum(start + part, length)
            g, d = tl.arange(0, GP), tl.arange(0, D)
            q = tl.load(q_ptr + (b * heads + h * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
            last = tl.zeros([GP], tl.int32) + length - 1  # no causal limit inside a decode row's length
            m, l, acc = _attend(q, k_ptr, v_ptr, table_ptr + b * max_blocks, h, s_p, s_h, start, end, last, scale,
                                R=GP, D=D, BLOCK=BLOCK, TILE=TILE)  # fmt: skip
            _store_state(m_ptr, l_ptr, acc_ptr, (b * heads_k + h) * PARTS + p, m, l, acc, R=GP, D=D)

    @triton.jit
    def _store_state(m_ptr, l_ptr, acc_ptr, at, m, l, acc, R: tl.constexpr, D: tl.constexpr):
        """One part's online-softmax state (running max, sum [R], unnormalised acc [R, D]) at index `at`."""
        i, d = tl.arange(0, R), tl.arange(0, D)
        tl.store(m_ptr + at * R + i, m)
        tl.store(l_ptr + at * R + i, l)
        tl.store(acc_ptr + (at * R + i)[:, None] * D + d[None, :], acc)

    @triton.jit
    def _merged(m_ptr, l_ptr, acc_ptr, first, parts, R: tl.constexpr, D: tl.constexpr):
        """The attention [R, D] (fp32) of the `parts` states stored from index `first` on, merged."""
        i, d = tl.arange(0, R), tl.arange(0, D)
        m_all = tl.full([R], float("-inf"), tl.float32)
        l_all = tl.zeros([R], tl.float32)
        acc_all = tl.zeros([R, D], tl.float32)
        for p in range(0, parts):
            at = first + p
            m = tl.load(m_ptr + at * R + i)
            m_new = tl.maximum(m_all, m)
            m_safe = _finite(m_new)
            mine, theirs = tl.exp(m_all - m_safe), tl.exp(m - m_safe)
            l_all = l_all * mine + tl.load(l_ptr + at * R + i) * theirs
            acc = tl.load(acc_ptr + (at * R + i)[:, None] * D + d[None, :])
            acc_all = acc_all * mine[:, None] + acc * theirs[:, None]
            m_all = m_new
        return acc_all / l_all[:, None]

    @triton.jit
    def _merge_parts_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, out_ptr, heads, G: tl.constexpr, GP: tl.constexpr,
                            D: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                            MIN_PART: tl.constexpr):  # fmt: skip
        # out [B, 1, heads, D] contiguous, in the query's dtype
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        heads_k = tl.num_programs(1)
        length = tl.load(len_ptr + b).to(tl.int32)
        used = tl.cdiv(length, _part_len(length, PARTS, TILE, MIN_PART))
        g, d = tl.arange(0, GP), tl.arange(0, D)
        out = _merged(m_ptr, l_ptr, acc_ptr, (b * heads_k + h) * PARTS, used, R=GP, D=D)
        where = out_ptr + (b * heads + h * G + g)[:, None] * D + d[None, :]
        tl.store(where, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, start_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, scale,
                        max_blocks, s_p, s_h, tokens, heads, G: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr,
                        D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        # q [R, heads, tokens, D] contiguous; k, v pools [P, Hk, D] (strides s_p, s_h, 1); table [slots,
        # max_blocks]; slot, start [R]: row r's tokens sit at positions start[r].. of slot[r], their K/V already
        # written; out [R, tokens, heads, D]. Query row i of the program: token BQ * tile + i // G, head h * G + i % G.
        # With PARTS > 1, program (r, h, tile * PARTS + p) walks part p of the tile's positions and stores its
        # state for _prefill_merge_kernel ([R, Hk, tiles, PARTS] states) instead of writing out.
        r, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        tile, p = tl.program_id(2) // PARTS, tl.program_id(2) % PARTS
        slot = tl.load(slot_ptr + r).to(tl.int64)
        start = tl.load(start_ptr + r).to(tl.int32)
        i, d = tl.arange(0, M), tl.arange(0, D)
        t = tile * BQ + i // G
        g = i % G
        live = (i < BQ * G) & (t < tokens)
        q = tl.load(q_ptr + ((r * heads + h * G + g) * tokens + t)[:, None] * D + d[None, :], mask=live[:, None],
                    other=0.0)  # fmt: skip
        pos = start + t  # each query's own position: it attends [0, pos]
        end = start + tl.minimum(tile * BQ + BQ, tokens)  # past the tile's last query
        table_row = table_ptr + slot * max_blocks
        if PARTS == 1:
            # position 0 is in the first tile: no query's running max stays -inf after it
            m, l, acc = _attend(q, k_ptr, v_ptr, table_row, h, s_p, s_h, 0, end, pos, scale, R=M, D=D, BLOCK=BLOCK,
                                TILE=TILE)  # fmt: skip
            _store_rows(out_ptr, acc / l[:, None], r, h, tile, tokens, heads, G=G, BQ=BQ, M=M, D=D)
        else:
            part = _part_len(end, PARTS, TILE, TILE)  # prefill parts: whole tiles of the launch's own size
            lo = p * part
            m, l, acc = _attend(q, k_ptr, v_ptr, table_row, h, s_p, s_h, lo, tl.minimum(lo + part, end), pos, scale,
                                R=M, D=D, BLOCK=BLOCK, TILE=TILE)  # fmt: skip
            at = (r * tl.num_programs(1) + h) * tl.cdiv(tokens, BQ) + tile
            _store_state(m_ptr, l_ptr, acc_ptr, at * PARTS + p, m, l, acc, R=M, D=D)

    @triton.jit
    def _prefill_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, tokens, heads, G: tl.constexpr, BQ: tl.constexpr,
                              M: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        # program (row, KV head, query tile): its PARTS states merged into out, as _prefill_kernel writes it
        r, h, tile = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
        at = (r * tl.num_programs(1) + h) * tl.num_programs(2) + tile
        out = _merged(m_ptr, l_ptr, acc_ptr, at * PARTS, PARTS, R=M, D=D)
        _store_rows(out_ptr, out, r, h, tile, tokens, heads, G=G, BQ=BQ, M=M, D=D)

    @triton.jit
    def _store_rows(out_ptr, out, r, h, tile, tokens, heads, G: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr,
                    D: tl.constexpr):  # fmt: skip
        """A prefill program's attention [M, D] into out [R, tokens, heads, D], its padding rows left out."""
        i, d = tl.arange(0, M), tl.arange(0, D)
        t, g = tile * BQ + i // G, i % G
        live = (i < BQ * G) & (t < tokens)
        where = out_ptr + ((r * tokens + t) * heads + h * G + g)[:, None] * D + d[None, :]
        tl.store(where, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def runs_on(query: torch.Tensor) -> bool:
    """Whether decode() and prefill() take this step: CUDA tensors with triton installed (tests point them at
    the CPU under Triton's interpreter by calling them directly)."""
    return serves(query.device)


def serves(device: torch.device) -> bool:
    """Whether attention over a paged cache on `device` runs in these kernels (else it is gathered)."""
    return torch.device(device).type == "cuda" and fused_ops.available()


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
        heads, G=group, GP=gp, D=dim, BLOCK=BLOCK, PARTS=PARTS, TILE=TILE, MIN_PART=MIN_PART)  # fmt: skip
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    _merge_parts_kernel[(batch, heads_k)](m, l, acc, lengths, out, heads, G=group, GP=gp, D=dim, PARTS=PARTS,
                                          TILE=TILE, MIN_PART=MIN_PART)  # fmt: skip
    return out


PREFILL_QUERIES = 16  # new tokens per prefill program: x G query heads, the rows of its [M, D] products
PREFILL_PARTS = 8  # the most parts a prefill program's positions are split into


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def prefill_parts(programs: int, device: torch.device) -> int:
    """Parts per prefill program for a grid of `programs`: enough for about two programs per SM (the
    scheduler then has a program to start where one ends), none for a grid that has them already. A grid's
    parts depend on its shape alone, so a CUDA graph captures one choice."""
    target = 2 * _sms(torch.device(device))
    return 1 if programs >= target else min(PREFILL_PARTS, -(-target // programs))


# The prefill kernel's launch: positions per inner step, warps, software-pipeline stages. On an H200 a tile of
# 32 positions beat 64 by 19% for a 128-token unit at 30,000 positions (0.240 against 0.297 ms a layer) and by
# 15% for a step of W2 rows, of 18 settings (perf/paged_prefill_bench.py --sweep; perf/README.md).
PREFILL_LAUNCH = {"tile": 32, "num_warps": 8, "num_stages": 3}


def prefill(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
            slots: torch.Tensor, starts: torch.Tensor, scaling: float, parts: int | None = None,
            launch: dict | None = None) -> torch.Tensor:  # fmt: skip
    """query [R, H, T, D]: row r's T new tokens at positions starts[r].. of slot slots[r], whose K/V are in the
    pools already; each attends causally to its slot's positions up to its own, through table [slots,
    max_blocks] int32. parts: splits of each program's positions (default: prefill_parts()); launch: the
    kernel's launch settings (default PREFILL_LAUNCH; perf/paged_prefill_bench.py --sweep tries others).
    -> [R, T, H, D]."""
    from ..core.block_pool import BLOCK

    rows, heads, tokens, dim = query.shape
    heads_k = k_pool.shape[1]
    group = heads // heads_k
    bq = PREFILL_QUERIES
    m = max(16, triton.next_power_of_2(bq * group))  # tl.dot wants at least 16 rows
    q = query.contiguous()
    out = torch.empty(rows, tokens, heads, dim, dtype=query.dtype, device=query.device)
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert slots.is_contiguous() and starts.is_contiguous()  # the kernel reads row r at offset r
    tiles = triton.cdiv(tokens, bq)
    parts = parts or prefill_parts(rows * heads_k * tiles, query.device)
    launch = launch or PREFILL_LAUNCH
    states = (rows, heads_k, tiles, parts, m)
    ml = [torch.empty(states if parts > 1 else 0, dtype=torch.float32, device=query.device) for _ in range(2)]
    acc = torch.empty((*states, dim) if parts > 1 else 0, dtype=torch.float32, device=query.device)
    _prefill_kernel[(rows, heads_k, tiles * parts)](
        q, k_pool, v_pool, table, slots, starts, out, *ml, acc, scaling, table.shape[1], k_pool.stride(0),
        k_pool.stride(1), tokens, heads, G=group, BQ=bq, M=m, D=dim, BLOCK=BLOCK, TILE=launch["tile"], PARTS=parts,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"])  # fmt: skip
    if parts > 1:
        _prefill_merge_kernel[(rows, heads_k, tiles)](*ml, acc, out, tokens, heads, G=group, BQ=bq, M=m, D=dim,
                                                      PARTS=parts, num_warps=8)  # fmt: skip
    return out
