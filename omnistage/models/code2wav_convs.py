# Code2Wav's causal convolutions without their copies. transformers pads each causal conv's input with
# F.pad (a full copy of the activation) and crops each transposed conv's output with a slice made
# contiguous (another copy); at 64 streams of a 25-frame chunk those copies were 29 of the stack's 126 ms
# of kernels on the H200 (perf/results/h200-step-streams.json). The same results come from the
# convolutions' own padding:
# - a causal conv (stride 1) pads both sides by its reach inside cuDNN and drops the extra outputs at the
#   end (a view: the next op reads it in place);
# - a transposed conv whose crops are equal (all of Code2Wav's) passes them as its `padding`, which
#   computes exactly the uncropped outputs' middle.
# The one-channel output conv (96 -> 1) ran cuDNN's generic implicit-GEMM kernel, which has no tensor-core
# path for one output channel: 25 ms of the 126. It is a Triton kernel here (fp32 accumulation, as cuDNN's).
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CAUSAL_CONV, TRANS_CONV = "Qwen3OmniMoeCausalConvNet", "Qwen3OmniMoeCausalTransConvNet"

if triton is not None:

    @triton.jit
    def _one_channel_conv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, channels, length, sx_b, sx_c,
                                 K: tl.constexpr, DILATION: tl.constexpr, C_BLOCK: tl.constexpr,
                                 T_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
        # out[b, t] = bias + sum_c sum_k w[c, k] * x[b, c, t - (K - 1) * DILATION + k * DILATION], zeros left
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * T_BLOCK + tl.arange(0, T_BLOCK)
        acc = tl.zeros([T_BLOCK], dtype=tl.float32)
        for c0 in range(0, channels, C_BLOCK):
            c = c0 + tl.arange(0, C_BLOCK)
            keep_c = c < channels
            for k in tl.static_range(K):
                src = t - (K - 1 - k) * DILATION
                keep = keep_c[:, None] & (src >= 0)[None, :] & (src < length)[None, :]
                x = tl.load(x_ptr + b * sx_b + c[:, None] * sx_c + src[None, :], mask=keep, other=0.0)
                w = tl.load(w_ptr + c * K + k, mask=keep_c, other=0.0)
                acc += tl.sum(x.to(tl.float32) * w.to(tl.float32)[:, None], axis=0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr).to(tl.float32)
        tl.store(out_ptr + b * length + t, acc.to(out_ptr.dtype.element_ty), mask=t < length)


def one_channel_conv(x: torch.Tensor, conv: torch.nn.Conv1d, dilation: int) -> torch.Tensor:
    """Causal conv of x [B, C, T] (last dim contiguous) to one channel: [B, 1, T]."""
    batch, channels, length = x.shape
    k = conv.kernel_size[0]
    out = torch.empty(batch, 1, length, dtype=x.dtype, device=x.device)
    weight = conv.weight.reshape(channels, k).contiguous()
    bias = conv.bias if conv.bias is not None else weight  # read from the device: float() would sync the host
    block = 256
    _one_channel_conv_kernel[(batch, triton.cdiv(length, block))](
        x, weight, bias, out, channels, length, x.stride(0), x.stride(1), K=k, DILATION=dilation,
        C_BLOCK=32, T_BLOCK=block, HAS_BIAS=conv.bias is not None)  # fmt: skip
    return out


def _causal_conv_forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
    conv = self.conv
    if (triton is not None and conv.out_channels == 1 and conv.groups == 1 and hidden_state.is_cuda
            and hidden_state.stride(-1) == 1):  # fmt: skip
        return one_channel_conv(hidden_state, conv, self.dilation)
    length = hidden_state.shape[-1]
    out = F.conv1d(hidden_state, conv.weight, conv.bias, stride=1, padding=self.padding, dilation=conv.dilation,
                   groups=conv.groups)  # fmt: skip
    return out[..., :length]  # outputs past the input's end saw the right padding


def _trans_conv_forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
    conv = self.conv
    return F.conv_transpose1d(hidden_state, conv.weight, conv.bias, stride=conv.stride, padding=self.left_pad,
                              dilation=conv.dilation, groups=conv.groups)  # fmt: skip


def install(module: torch.nn.Module) -> int:
    """Swaps the forward of every causal conv (stride 1, the only kind Code2Wav has) and of every
    transposed conv with equal crops; returns how many. Others keep transformers' forward."""
    swapped = 0
    for m in module.modules():
        name = type(m).__name__
        if name == CAUSAL_CONV and m.stride == 1 and m.conv.padding == (0,):
            m.forward = types.MethodType(_causal_conv_forward, m)
        elif name == TRANS_CONV and m.left_pad == m.right_pad and m.conv.padding == (0,):
            m.forward = types.MethodType(_trans_conv_forward, m)
        else:
            continue
        swapped += 1
    return swapped
