# Fewer kernels per decoder layer: q/k/v as one GEMM followed by one kernel for the per-head q/k RMSNorm
# and the rotary embedding, and the MLP's gate/up as one GEMM followed by one silu(gate) * up kernel.
# Transformers runs those as 3 GEMMs + 3 kernels (with fused_ops' norm and rope) and 2 GEMMs + 2
# elementwise kernels. A talker frame (20 talker layers, then 15 code-predictor sub-steps of 5 layers) is
# bound by its ~3100 small kernels, not by their work: this removes 565 of them, 2545 left
# (perf/results/h200-step-streams.json).
#
# The merged weights are views of one tensor that the original q/k/v (gate/up) parameters now also view,
# so memory does not grow. The kernels round as transformers' bf16 ops do (each op's result rounded to
# the input dtype); the merged GEMM may accumulate in another order than the three separate ones.
# install(model) swaps the forward of the decoder stacks' attention and dense MLP modules (call it once the
# model is on its device: the merged weights are plain attributes); CPU tensors keep transformers' forward.
from __future__ import annotations

import types

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

from . import fused_ops, gemv

if fused_ops.available():
    import triton
    import triton.language as tl

    from .fused_ops import _cast, _rotated, _rounded, _silu_times

# head rows of one token per qkv_into_cache program: the thinker's 32 + 4 + 4 in five
QKV_ROWS = 8
# pairs per pass of an expert_order program: a decode step's (64 rows x 8) in one
EXPERT_ORDER_BLOCK = 1024

# the thinker's and talker's text attention (one class) and the code predictor's; their dense MLPs
ATTENTION_CLASSES = ("Qwen3OmniMoeThinkerTextAttention", "Qwen3OmniMoeTalkerCodePredictorAttention")
MLP_CLASSES = ("Qwen3OmniMoeMLP", "Qwen3OmniMoeTalkerTextMLP", "Qwen3OmniMoeThinkerTextMLP")

if fused_ops.available():

    @triton.jit
    def _qkv_into_cache_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, start,
                               heads_q, heads_k, seq, s_b, s_t, cs_b, cs_t, c_b, c_h, c_t, eps_q, eps_k,
                               HALF: tl.constexpr, ROWS: tl.constexpr, HAS_POS: tl.constexpr,
                               PAGED: tl.constexpr):  # fmt: skip
        # one program per (token, ROWS head rows of it): qkv [B, T, (Hq + 2 Hk) * D] with a contiguous last
        # dim holds each token's q heads, then k heads, then v heads. q rows (normed, rotated) go to q [B, Hq,
        # T, D] contiguous, k rows (normed, rotated) and v rows (as they are) to K/V buffers [B', Hk, L, D]
        # (strides c_b, c_h, c_t, shared) at position start + t (+ pos[b] per batch row with HAS_POS): a
        # cache, or fresh tensors; PAGED: a paged pool viewed as [1, Hk, P, D], at its row pos[b, t]
        token = tl.program_id(0).to(tl.int64)
        b, t = token // seq, token % seq
        j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # the token's head rows: q, then k, then v
        is_q = j < heads_q
        is_k = (j >= heads_q) & (j < heads_q + heads_k)
        is_v = (j >= heads_q + heads_k) & (j < heads_q + 2 * heads_k)
        live = (is_q | is_k | is_v)[:, None]
        dt = q_ptr.dtype.element_ty
        i = tl.arange(0, HALF)
        src = qkv_ptr + b * s_b + t * s_t + j[:, None] * 2 * HALF + i[None, :]
        x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
        # transformers' per-head RMSNorm (rounded to dt, then times the weight), then the rotary, on q and k
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        scale = (1.0 / tl.sqrt_rn(variance + tl.where(is_q, eps_q, eps_k)))[:, None]
        pick_q = is_q[:, None]
        w1 = tl.where(pick_q, tl.load(qw_ptr + i)[None, :], tl.load(kw_ptr + i)[None, :]).to(tl.float32)
        w2 = tl.where(pick_q, tl.load(qw_ptr + HALF + i)[None, :], tl.load(kw_ptr + HALF + i)[None, :]).to(tl.float32)
        n1, n2 = _rounded(w1 * _rounded(x1 * scale, dt), dt), _rounded(w2 * _rounded(x2 * scale, dt), dt)
        lo, hi = _rotated(n1, n2, cos_ptr + b * cs_b + t * cs_t, sin_ptr + b * cs_b + t * cs_t, i[None, :], HALF, dt)
        pick_v = is_v[:, None]
        lo, hi = tl.where(pick_v, x1, lo), tl.where(pick_v, x2, hi)
        h = tl.where(is_q, j, tl.where(is_k, j - heads_q, j - heads_q - heads_k))
        if PAGED:
            cached = h * c_h + tl.load(pos_ptr + b * seq + t) * c_t
        else:
            position = start + t
            if HAS_POS:
                position += tl.load(pos_ptr + b)
            cached = b * c_b + h * c_h + position * c_t
        # each kind of row to its own tensor: masked stores, no select between pointers of two tensors
        lo, hi = _cast(lo, dt), _cast(hi, dt)
        q_dst = q_ptr + (((b * heads_q + h) * seq + t) * 2 * HALF)[:, None] + i[None, :]
        tl.store(q_dst, lo, mask=pick_q)
        tl.store(q_dst + HALF, hi, mask=pick_q)
        kv_dst = cached[:, None] + i[None, :]
        tl.store(kc_ptr + kv_dst, lo, mask=is_k[:, None])
        tl.store(kc_ptr + kv_dst + HALF, hi, mask=is_k[:, None])
        tl.store(vc_ptr + kv_dst, lo, mask=pick_v)
        tl.store(vc_ptr + kv_dst + HALF, hi, mask=pick_v)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, width, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        # gu [rows, 2 * width] (gate, then up), out [rows, width]: silu(gate) rounded, times up, rounded
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = j < width
        dt = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * 2 * width + j, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * width + width + j, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + j, _silu_times(g, u, dt, LIBDEVICE).to(dt), mask=keep)

    @triton.jit
    def _combine_experts_kernel(down_ptr, pos_ptr, w_ptr, out_ptr, width, TOP_K: tl.constexpr,
                                ROUND_PRODUCT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        # out[t] = sum over k of down[pos[t, k]] * w[t, k]: each product rounded to bf16 where transformers'
        # mul gives bf16 (ROUND_PRODUCT), summed in float32 in k order as torch's sum over k, rounded once
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = j < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(pos_ptr + t * TOP_K + k).to(tl.int64)
            w = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
            d = tl.load(down_ptr + row * width + j, mask=keep, other=0.0).to(tl.float32)
            if ROUND_PRODUCT:
                acc += _rounded(d * w, tl.bfloat16)
            else:
                acc += d * w
        tl.store(out_ptr + t * width + j, _cast(acc, out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _expert_order_kernel(ids_ptr, ends_ptr, rows_ptr, pos_ptr, pairs, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        # one program per expert e: the (token, expert) pairs ids [pairs] (pair p is token p // TOP_K's) put
        # in expert order, stably, by counting: e's run starts after the pairs of lower experts, and a pair of
        # e takes the next row of the run; pos[p] = pair p's row, rows[pos[p]] = its token, ends[e] = where
        # e's run ends. Every program reads all the pairs (a decode step's are a few KB, in L2).
        e = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        row = 0
        for start in range(0, pairs, BLOCK):
            ids = tl.load(ids_ptr + start + i, mask=start + i < pairs, other=-1)
            row += tl.sum((ids < e) & (ids >= 0), axis=0).to(tl.int32)
        for start in range(0, pairs, BLOCK):
            p = start + i
            hit = (tl.load(ids_ptr + p, mask=p < pairs, other=-1) == e).to(tl.int32)
            pos = row + tl.cumsum(hit, axis=0) - hit  # earlier pairs of e in this block go first
            tl.store(pos_ptr + p, pos.to(tl.int64), mask=hit == 1)
            tl.store(rows_ptr + pos, (p // TOP_K).to(tl.int64), mask=hit == 1)
            row += tl.sum(hit, axis=0)
        tl.store(ends_ptr + e, row)


def qk_norm_rope(qkv: torch.Tensor, heads_q: int, heads_k: int, q_norm, k_norm, cos, sin):
    """qkv [B, T, (Hq + 2 Hk) * D] -> q [B, Hq, T, D], k and v [B, Hk, T, D], contiguous: per-head RMSNorm,
    then rope, on q and k; v as it is."""
    batch, seq, _ = qkv.shape
    k = torch.empty(batch, heads_k, seq, q_norm.weight.shape[0], dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    return qkv_into_cache(qkv, heads_q, heads_k, q_norm, k_norm, cos, sin, k, v), k, v


def qkv_into_cache(qkv: torch.Tensor, heads_q: int, heads_k: int, q_norm, k_norm, cos, sin, k_cache, v_cache,
                   start: int = 0, positions: torch.Tensor | None = None,
                   phys: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """qk_norm_rope, with k (normed, rotated) and v written into K/V buffers [B', Hk, L, D] (same strides) at
    position start + t of batch row b (+ positions[b] when given), or with phys [B, T] (a paged pool viewed
    as [1, Hk, P, D]) at position phys[b, t]; returns q [B, Hq, T, D]."""
    batch, seq, _ = qkv.shape
    dim = q_norm.weight.shape[0]
    q = torch.empty(batch, heads_q, seq, dim, dtype=qkv.dtype, device=qkv.device)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    cs_b = cos.stride(0) if cos.shape[0] == batch else 0  # [1, T, D]: every row reads the same angles
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    # a token's head rows in groups of QKV_ROWS, each group one program: with one program per head row, a
    # prefill's ~96k rows (16 W1 prompts, thinker) were latency-bound at ~76 us a layer on the H100
    _qkv_into_cache_kernel[(batch * seq, triton.cdiv(heads_q + 2 * heads_k, QKV_ROWS))](
        qkv, q_norm.weight, k_norm.weight, cos, sin, q, k_cache, v_cache,
        phys if phys is not None else positions if positions is not None else q, start, heads_q, heads_k, seq,
        qkv.stride(0), qkv.stride(1), cs_b, cos.stride(1), *k_cache.stride()[:3], q_norm.variance_epsilon,
        k_norm.variance_epsilon, HALF=dim // 2, ROWS=QKV_ROWS, HAS_POS=positions is not None,
        PAGED=phys is not None)  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate, up) -> [..., I]: silu(gate) * up, rounded as transformers' two ops."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.contiguous().view(-1, 2 * width)
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, BLOCK=block,
                                                                  LIBDEVICE=fused_ops.has_libdevice())  # fmt: skip
    return out.view(*gate_up.shape[:-1], width)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gemv.linear(silu_mul(gate_up), weight, bias), as one kernel where the one-row GEMV takes it."""
    if not gemv.takes(gate_up, weight, bias):
        return torch.nn.functional.linear(silu_mul(gate_up), weight, bias)
    out = gemv.gemv(gate_up.reshape(-1, gate_up.shape[-1]), weight, silu_mul=True)
    return out.view(*gate_up.shape[:-1], weight.shape[0])


def combine_experts(down: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
    """The experts' outputs back to their tokens: down [S, H] in expert-sorted order, positions [T, K] (the row
    of pair (t, k) in it), weights [T, K] -> [T, H] in dtype. One kernel for transformers' unsort, weighting
    and sum over k (three passes over S rows, the weighted ones in float32 when the weights are)."""
    tokens, top_k = positions.shape
    width = down.shape[-1]
    out = torch.empty(tokens, width, dtype=dtype, device=down.device)
    block = min(1024, triton.next_power_of_2(width))
    round_product = torch.promote_types(down.dtype, weights.dtype) == torch.bfloat16
    _combine_experts_kernel[(tokens, triton.cdiv(width, block))](
        down.contiguous(), positions.contiguous(), weights.contiguous(), out, width, TOP_K=top_k,
        ROUND_PRODUCT=round_product, BLOCK=block)  # fmt: skip
    return out


def expert_order(top_k_index: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's (token, expert) pairs top_k_index [T, K] in expert order, as a stable sort would put them:
    (ends [E] int32, the inclusive count of pairs per expert that grouped GEMMs take as offsets; rows [T * K],
    the token of each pair in that order; positions [T, K], the row of pair (t, k) in it). One kernel for
    what torch.sort, histc, cumsum, a division and an inverse permutation do in six."""
    tokens, top_k = top_k_index.shape
    pairs = tokens * top_k
    device = top_k_index.device
    ends = torch.empty(n_experts, dtype=torch.int32, device=device)
    rows = torch.empty(pairs, dtype=torch.int64, device=device)
    positions = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    block = min(EXPERT_ORDER_BLOCK, triton.next_power_of_2(pairs))
    _expert_order_kernel[(n_experts,)](top_k_index.contiguous(), ends, rows, positions, pairs, TOP_K=top_k,
                                       BLOCK=block)  # fmt: skip
    return ends, rows, positions


def fused_tensor(t: torch.Tensor) -> bool:
    """Whether the fused kernels take this tensor: CUDA ones (experts.py asks too)."""
    return t.is_cuda  # tests point this at CPU tensors too (Triton's interpreter)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    if not fused_tensor(hidden_states) or hidden_states.dim() != 3:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)  # fmt: skip
    batch, seq, _ = hidden_states.shape
    qkv = gemv.linear(hidden_states, self.qkv_weight, self.qkv_bias)
    heads_q, heads_k = self.config.num_attention_heads, self.config.num_key_value_heads
    target = past_key_values.kv_target(self.layer_idx, seq) if hasattr(past_key_values, "kv_target") else None
    if target is not None:  # the cache takes K and V in place: one kernel instead of three
        q = qkv_into_cache(qkv, heads_q, heads_k, self.q_norm, self.k_norm, *position_embeddings, target.k, target.v,
                           target.start, target.positions, target.phys)  # fmt: skip
        # a paged decode step attends through its block tables in one kernel (None: it gathers instead)
        paged = past_key_values.attend(self.layer_idx, q, self.scaling) if hasattr(past_key_values, "attend") else None
        if paged is not None:
            return gemv.linear(paged.reshape(batch, seq, -1), self.o_proj.weight, self.o_proj.bias), None
        k, v = past_key_values.attended(self.layer_idx, seq)
    else:
        q, k, v = qk_norm_rope(qkv, heads_q, heads_k, self.q_norm, self.k_norm, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                               modeling.eager_attention_forward)  # fmt: skip
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)  # fmt: skip
    return gemv.linear(out.reshape(batch, seq, -1).contiguous(), self.o_proj.weight, self.o_proj.bias), weights


def _mlp_forward(self, x):
    if not fused_tensor(x) or self.config.hidden_act != "silu":
        return type(self).forward(self, x)
    return silu_mul_linear(gemv.linear(x, self.gate_up_weight), self.down_proj.weight, self.down_proj.bias)


def _merge(*linears: torch.nn.Linear) -> torch.Tensor:
    """One weight holding the linears' weights stacked; each linear's parameter becomes a view of it."""
    merged = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(merged[start : start + rows], requires_grad=False)
        start += rows
    return merged


def install(model: torch.nn.Module) -> int:
    """Merged q/k/v and gate/up projections with fused epilogues in the decoder stacks, and, for experts run
    by lean_grouped_mm, silu(gate) * up and the way back to the tokens as one kernel each; returns how many
    modules were changed (0 without triton)."""
    if not fused_ops.available():
        return 0
    from .experts import is_experts_module  # experts.py calls this module's kernels: imported here, not at the top

    swapped = 0
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION_CLASSES:
            module.qkv_weight = _merge(module.q_proj, module.k_proj, module.v_proj)
            biases = [m.bias for m in (module.q_proj, module.k_proj, module.v_proj)]
            module.qkv_bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            module.forward = types.MethodType(_attention_forward, module)
        elif name in MLP_CLASSES:
            module.gate_up_weight = _merge(module.gate_proj, module.up_proj)
            module.forward = types.MethodType(_mlp_forward, module)
        elif is_experts_module(module):
            # the experts' gate/up is one weight already; lean_grouped_mm (experts.py) reads this flag for
            # its fused silu(gate) * up and its fused way back to the tokens
            module.fused_epilogues = True
        else:
            continue
        swapped += 1
    return swapped
