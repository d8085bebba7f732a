# Triton kernels for the two most frequent small ops of a decode step, RMSNorm and the rotary embedding of
# q and k, each one kernel where transformers runs 6-10. A talker frame (talker step + 15 code-predictor
# sub-steps) ran ~7000 kernels on the H200, 396 RMSNorms among them, at ~2 us each: kernel count, not
# bandwidth, set its time (perf/results/h200-static-prefill.json). Both kernels round like transformers'
# bf16 code (to the input dtype before the weight; each product rounded before the sum), so they
# replace it without changing results beyond the last bit of rsqrt. bf16 rounding is done by hand
# (_rounded): Triton's float32 -> bf16 cast truncated, which left 2/3 of the values a step towards 0.
#
# Code2Wav's SnakeBeta activation (x + 1/beta * sin(alpha * x)^2, 29 of them in its conv stack) runs as
# five eager elementwise ops over tensors of up to 96 channels x 1920 samples per frame: ~11 passes over
# memory where one read and one write do. The fused kernel rounds after each op as torch's bf16 ops do.
#
# The vision encoder's rotary embedding is float32 in transformers: q and k copied to float32, rotated in
# five more passes, copied back. vision_rope reads q and k once and writes them once, with the same float32
# rounding (no FMA contraction), bit for bit, and takes a third off the vision encoder's time
# (perf/results/h100-vision-rope.json). stages/vision_encoder.py calls it for CUDA tensors.
#
# install(model) swaps the forward of the model's text RMSNorm and SnakeBeta modules and, once per
# process, the modeling module's apply_rotary_pos_emb; all fall back to transformers' own code for CPU
# tensors, so only CUDA steps change. Without the triton package, install() leaves everything as it is.
from __future__ import annotations

import logging
import os
import types

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: nothing to fuse
    triton = None

log = logging.getLogger(__name__)
# the decoder stacks' norms (thinker and talker text models, code predictor); all share transformers' formula
NORM_CLASSES = ("Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm", "Qwen3OmniMoeRMSNorm")
SNAKE_CLASSES = ("Qwen3OmniMoeSnakeBeta", "SnakeBeta")  # Code2Wav's conv stack (SnakeBeta: deprecated alias)
_original_rope = modeling.apply_rotary_pos_emb

if triton is not None:

    @triton.jit
    def _rounded(x, dt: tl.constexpr):
        """float32 x rounded to dt (to nearest even, as torch), still as float32. bf16 by hand: Triton's
        casts truncated, on the H200 and in its interpreter alike, fp_downcast_rounding or not."""
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(dt).to(tl.float32)

    @triton.jit
    def _cast(x, dt: tl.constexpr):
        return _rounded(x, dt).to(dt)  # exact: the value is already one of dt's

    @triton.jit
    def _silu_times(g, u, dt: tl.constexpr, LIBDEVICE: tl.constexpr):
        """silu(g) * u from float32 g and u of dtype dt, rounded as transformers' two ops: silu(g) to dt,
        then the product to dt (returned as float32)."""
        e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
        return _rounded(_rounded(g / (1.0 + e), dt) * u, dt)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / n_cols
        normed = _rounded(x * (1.0 / tl.sqrt_rn(variance + eps)), x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, _cast(w * normed, out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        # a decoder layer's residual add (rounded to the input dtype, as torch's) and the RMSNorm of the sum
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        dt = sum_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        total = _rounded(x + r, dt)
        tl.store(sum_ptr + row * n_cols + cols, _cast(total, dt), mask=keep)
        variance = tl.sum(total * total, axis=0) / n_cols
        normed = _rounded(total * (1.0 / tl.sqrt_rn(variance + eps)), dt)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, _cast(w * normed, out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _rotated(x1, x2, cos_row, sin_row, i, HALF: tl.constexpr, dt: tl.constexpr):
        """Both halves of one row rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each
        product rounded to dt as in bf16 torch; cos_row/sin_row point at the row's angles."""
        c1, c2 = tl.load(cos_row + i).to(tl.float32), tl.load(cos_row + HALF + i).to(tl.float32)
        s1, s2 = tl.load(sin_row + i).to(tl.float32), tl.load(sin_row + HALF + i).to(tl.float32)
        lo = _rounded(x1 * c1, dt) + _rounded(-x2 * s1, dt)
        hi = _rounded(x2 * c2, dt) + _rounded(x1 * s2, dt)
        return lo, hi

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_rows, heads_q, heads_k, seq,
                     qs_b, qs_h, qs_t, ks_b, ks_h, ks_t, cs_b, cs_t, HALF: tl.constexpr):  # fmt: skip
        # one program per (batch, head, position) row of q, then of k; last dims are contiguous
        row = tl.program_id(0).to(tl.int64)
        is_q = row < q_rows
        r = tl.where(is_q, row, row - q_rows)
        heads = tl.where(is_q, heads_q, heads_k)
        b, h, t = r // (heads * seq), (r // seq) % heads, r % seq
        offset = tl.where(is_q, b * qs_b + h * qs_h + t * qs_t, b * ks_b + h * ks_h + t * ks_t)
        src = tl.where(is_q, q_ptr, k_ptr)
        dst = tl.where(is_q, qo_ptr, ko_ptr)
        i = tl.arange(0, HALF)
        x1 = tl.load(src + offset + i).to(tl.float32)
        x2 = tl.load(src + offset + HALF + i).to(tl.float32)
        dt = qo_ptr.dtype.element_ty
        lo, hi = _rotated(x1, x2, cos_ptr + b * cs_b + t * cs_t, sin_ptr + b * cs_b + t * cs_t, i, HALF, dt)
        tl.store(dst + offset + i, _cast(lo, dt))
        tl.store(dst + offset + HALF + i, _cast(hi, dt))

    @triton.jit
    def _vision_rope_kernel(qk_ptr, cos_ptr, sin_ptr, out_ptr, heads, s_n, s_j, s_h, cs_n,
                            HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        # one program per patch: its q and k heads (rows j * heads + h) against the patch's float32 angles;
        # x * cos + rotate_half(x) * sin in float32, each product and the sum rounded (launched without FMA
        # contraction), then rounded to the output dtype: transformers' float32 vision rotary, bit for bit
        n = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, ROWS)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        keep = (r < 2 * heads) & (i < HALF)
        src = qk_ptr + n * s_n + (r // heads) * s_j + (r % heads) * s_h
        x1 = tl.load(src + i, mask=keep, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=keep, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + n * cs_n + i, mask=i < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + n * cs_n + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + n * cs_n + i, mask=i < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + n * cs_n + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        dst = out_ptr + n * (2 * heads * 2 * HALF) + r * (2 * HALF)
        tl.store(dst + i, _cast(x1 * c1 + (-x2) * s1, dt), mask=keep)
        tl.store(dst + HALF + i, _cast(x2 * c2 + x1 * s2, dt), mask=keep)

    @triton.jit
    def _snake_kernel(x_ptr, alpha_ptr, inv_beta_ptr, out_ptr, channels, length, sx_b, sx_c,
                      BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        # grid (batch * channels, blocks of length): x [B, C, T] with a contiguous last dim (a view cut
        # from a longer conv output is fine), out contiguous; alpha, inv_beta [C] already exp(alpha) and
        # 1 / (exp(beta) + eps) in x's dtype, as transformers computes them
        row = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = t < length
        dt = x_ptr.dtype.element_ty
        channel = row % channels
        x = tl.load(x_ptr + (row // channels) * sx_b + channel * sx_c + t, mask=keep, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + channel).to(tl.float32)
        inv_b = tl.load(inv_beta_ptr + channel).to(tl.float32)
        # each op rounded as torch's: x * a, sin, ^2, * 1/b, + x; libdevice's sin is the accurate one
        # (Triton's CPU interpreter has no libdevice; its tl.sin is numpy's)
        ax = _rounded(x * a, dt)
        s = _rounded(libdevice.sin(ax) if LIBDEVICE else tl.sin(ax), dt)
        y = x + _rounded(inv_b * _rounded(s * s, dt), dt)
        tl.store(out_ptr + row * length + t, _cast(y, dt), mask=keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in one kernel: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual + x and transformers' RMSNorm of that sum, in one kernel: returns (sum, normed)."""
    n = x.shape[-1]
    x2, r2 = x.contiguous().view(-1, n), residual.contiguous().view(-1, n)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, total, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return total.view(x.shape), out.view(x.shape)


def is_fused_norm(module: torch.nn.Module) -> bool:
    """Whether install() swapped this module's forward for the fused RMSNorm (so add_rms_norm may stand in)."""
    return getattr(module.forward, "__func__", None) is _norm_forward


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1) for q [B, Hq, T, D], k [B, Hk, T, D] with
    contiguous last dims and cos/sin [B or 1, T, D], in one kernel."""
    batch, heads_q, seq, dim = q.shape
    heads_k = k.shape[1]
    cos, sin = cos.expand(batch, seq, dim).contiguous(), sin.expand(batch, seq, dim).contiguous()
    # the kernel writes each output row at its input row's offset, so outputs take the inputs' strides;
    # a view that empty_like cannot reproduce (not dense: q and k sliced from one projection) is copied
    q, k = (t if torch.empty_like(t).stride() == t.stride() else t.contiguous() for t in (q, k))
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    q_rows = batch * heads_q * seq
    _rope_kernel[(q_rows + batch * heads_k * seq,)](
        q, k, cos, sin, q_out, k_out, q_rows, heads_q, heads_k, seq, *q.stride()[:3], *k.stride()[:3],
        *cos.stride()[:2], HALF=dim // 2,
    )  # fmt: skip
    return q_out, k_out


def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta on x [B, C, T] in one kernel, given exp(alpha) and 1 / (exp(beta) + eps) per channel;
    the output is contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(length))
    _snake_kernel[(batch * channels, triton.cdiv(length, block))](
        x, alpha, inv_beta, out, channels, length, x.stride(0), x.stride(1), BLOCK=block, LIBDEVICE=has_libdevice())
    return out


def vision_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' float32 vision rotary of q and k in one kernel: qk [N, 2, H, D] (a view cut from the
    qkv projection is fine), cos / sin [N, D] float32; returns [N, 2, H, D] contiguous in qk's dtype."""
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    patches, _, heads, dim = qk.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    _vision_rope_kernel[(patches,)](
        qk, cos, sin, out, heads, qk.stride(0), qk.stride(1), qk.stride(2), cos.stride(0), HALF=dim // 2,
        ROWS=triton.next_power_of_2(2 * heads), BLOCK=triton.next_power_of_2(dim // 2), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def has_libdevice() -> bool:
    """Whether kernels may call libdevice's accurate math: not in Triton's CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def snake_factors(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(alpha) and 1 / (exp(beta) + eps) of a SnakeBeta module, with transformers' own ops and dtype."""
    with torch.no_grad():
        return module.alpha.exp(), 1.0 / (module.beta.exp() + module.no_div_by_zero)


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.stride(-1) == 1 for t in tensors)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not hidden_states.is_cuda:
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _snake_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not hidden_states.is_cuda or hidden_states.dim() != 3:
        return type(self).forward(self, hidden_states)
    # the factors once per module: inference weights do not change (a reload builds new modules)
    factors = self.__dict__.get("_fused_factors")
    if factors is None or factors[0].device != hidden_states.device:
        factors = self.__dict__["_fused_factors"] = snake_factors(self)
    return snake(hidden_states, *factors)


def _rope_forward(q, k, cos, sin, unsqueeze_dim=1):
    if unsqueeze_dim != 1 or q.dim() != 4 or q.shape[-1] % 2 or not _fusable(q, k, cos, sin):
        return _original_rope(q, k, cos, sin, unsqueeze_dim)
    return rope(q, k, cos, sin)


def available() -> bool:
    return triton is not None


def install(model: torch.nn.Module) -> int:
    """Fused RMSNorm on the model's decoder norms, fused SnakeBeta on Code2Wav's activations and fused rotary
    embedding in the modeling module; returns how many modules were swapped (0 without triton)."""
    if triton is None:
        log.warning("fused kernels requested but the triton package is missing: transformers' ops stay")
        return 0
    modeling.apply_rotary_pos_emb = _rope_forward
    swapped = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORM_CLASSES or name in SNAKE_CLASSES:
            forward = _norm_forward if name in NORM_CLASSES else _snake_forward
            module.forward = types.MethodType(forward, module)
            swapped += 1
    return swapped
