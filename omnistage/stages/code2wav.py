# Code2Wav stage runner: decodes many windows of codec frames (from many requests) into waveform samples,
# one batched forward per window length. Windows come from omnistage.core.chunking; each returns only the
# samples that became final (see the geometry note there).
from __future__ import annotations

import contextlib
import operator
from collections import defaultdict

import torch

from omnistage.core.errors import BadRequestError


@contextlib.contextmanager
def _native_cpu_convs():
    # oneDNN builds its conv primitives per input shape (measured, tiny model, 2 cores: 1.3-8 s on the first
    # call of each new window length, then 0.25-0.9 s) and window lengths vary from call to call; NNPACK, what
    # torch picks next, is 3x slower on batches (16 x 56 frames: 5.5 s vs 1.8 s). The native convs have no
    # per-shape cost and match oneDNN's warm speed. Only the `enabled` flags are touched:
    # torch.backends.mkldnn.flags() also sets the oneDNN TF32 flag, which warns. The flags are process-wide.
    mkldnn = torch.backends.mkldnn.set_flags(_enabled=False)[0]
    nnpack = torch.backends.nnpack.set_flags(False)[0]
    try:
        yield
    finally:
        torch.backends.nnpack.set_flags(nnpack)
        torch.backends.mkldnn.set_flags(_enabled=mkldnn)


class Code2WavRunner:
    def __init__(self, module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype):
        # The module is loaded elsewhere, already in `dtype`: casting here with .to(dtype) would also cast
        # the rotary inv_freq buffers, which from_pretrained / _from_config(dtype=...) keep in fp32.
        param_dtype = next(module.parameters()).dtype
        if param_dtype != dtype:
            raise ValueError(f"code2wav module is {param_dtype}, expected {dtype}; load it in that dtype")
        self.device = torch.device(device)
        self.dtype = dtype
        self.module = module.to(self.device).eval()
        config = module.config
        self.num_quantizers = int(config.num_quantizers)
        self.codebook_size = int(config.codebook_size)
        # Measured rather than taken from the config: output length = frames * samples_per_frame - tail.
        zeros = torch.zeros(1, 2, self.num_quantizers, dtype=torch.long)  # [1, T, Q]
        len1, len2 = (self._forward(zeros[:, :t]).shape[-1] for t in (1, 2))
        self.samples_per_frame = len2 - len1  # 1920 for Qwen3-Omni
        self.tail_samples = self.samples_per_frame - len1  # 555: the non-final end of every window
        if not 0 <= self.tail_samples < self.samples_per_frame:
            raise RuntimeError(
                f"code2wav geometry unsupported: {self.samples_per_frame} samples per frame, "
                f"tail {self.tail_samples}"
            )

    def output_samples(self, frames: int, context: int) -> int:
        """Samples decode() returns for a window of `frames` frames with `context` left-context frames."""
        return (frames - context) * self.samples_per_frame - (self.tail_samples if context == 0 else 0)

    def validate(self, codes: torch.Tensor, context: int) -> None:
        """Checks one window as decode() does (syncs the device for the value range)."""
        self._check_shape(codes, context)
        self._check_values(codes)

    @torch.inference_mode()
    def decode(self, windows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """windows: (codes [T, Q] int, context frames). Returns per window float32 [samples] on self.device:
        the samples of frames [context, T), minus the non-final tail (the whole window when context == 0)."""
        contexts = []
        groups: dict[int, list[int]] = defaultdict(list)  # frames T -> window indices
        for i, (codes, context) in enumerate(windows):
            try:
                contexts.append(self._check_shape(codes, context))
            except BadRequestError as e:
                raise BadRequestError(f"code2wav window {i}: {e}") from None
            groups[codes.shape[0]].append(i)
        batches = {
            t: torch.stack([windows[i][0].to(self.device, torch.long, non_blocking=True) for i in idx])  # [B, T, Q]
            for t, idx in groups.items()
        }
        # Value range of every group with one host sync, before any forward runs.
        bounds = torch.stack([torch.stack([b.min(), b.max()]) for b in batches.values()]).tolist() if batches else []
        for idx, (lo, hi) in zip(groups.values(), bounds):
            if lo < 0 or hi >= self.codebook_size:
                for i in idx:
                    try:
                        self._check_values(windows[i][0])
                    except BadRequestError as e:
                        raise BadRequestError(f"code2wav window {i}: {e}") from None

        out: list[torch.Tensor | None] = [None] * len(windows)
        for t, idx in groups.items():
            wav = self._forward(batches[t])  # [B, T * spf - tail]
            for row, i in enumerate(idx):
                context = contexts[i]
                first = context * self.samples_per_frame - self.tail_samples if context else 0
                out[i] = wav[row, first:].float()  # a view of the batch output; the caller copies it out
        return out

    def _forward(self, codes: torch.Tensor) -> torch.Tensor:
        # codes [B, T, Q] -> wav [B, T * spf - tail]; equal lengths only, so no padding or attention mask.
        with torch.inference_mode(), _native_cpu_convs() if self.device.type == "cpu" else contextlib.nullcontext():
            return self.module(codes.to(self.device).transpose(1, 2))[:, 0]

    def _check_shape(self, codes: object, context: object) -> int:
        if not isinstance(codes, torch.Tensor):
            raise BadRequestError(f"codes must be a tensor, got {type(codes).__name__}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise BadRequestError(f"codes must be integers, got {codes.dtype}")
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers or codes.shape[0] < 1:
            raise BadRequestError(f"codes must be [frames >= 1, {self.num_quantizers}], got {list(codes.shape)}")
        try:
            if isinstance(context, bool):
                raise TypeError
            context = operator.index(context)
        except TypeError:
            raise BadRequestError(f"context_frames must be an int, got {context!r}") from None
        if not 0 <= context < codes.shape[0]:
            raise BadRequestError(f"context_frames must be in [0, frames = {codes.shape[0]}), got {context}")
        return context

    def _check_values(self, codes: torch.Tensor) -> None:
        lo, hi = (int(v) for v in torch.stack([codes.min(), codes.max()]).tolist())
        if lo < 0 or hi >= self.codebook_size:
            raise BadRequestError(f"codes must be in [0, {self.codebook_size}), got values in [{lo}, {hi}]")
