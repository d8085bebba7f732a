# Streaming Code2Wav with carried state: the chunks of a stream, concatenated, equal the full decode (float
# tolerance) at any chunk schedule, with bounded state and bounded work per chunk.
#
# Why state: the pre-transformer's 8 sliding-window layers reach ~8 * 71 frames back, so stateless windows
# with a short left context decode a different signal. Instead each stream carries (1) per layer the post-rope
# K/V of its last `window - 1` frames (under transformers' rule q - window < k <= q no new query sees further
# back), (2) the last C pre-transformer outputs (after the final norm), C = the left reach of the conv stack
# (upsample + decoder) in frames, derived from its geometry, and (3) the number of frames decoded so far (rope
# positions and the window mask are absolute). A chunk of n frames runs the transformer layers (transformers'
# own modules) on the n new rows only, and the conv stack on C + n rows.
#
# The runner keeps no state: its caller (code2wav_stage.py, where each stream's state stays resident) hands
# the state in and gets the new one back, so chunks of many streams batch. Chunks with equal (n, W, C') shapes
# run as one forward.
from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
)

from omnistage.core.errors import BadRequestError

from .host_copy import to_device

# Frames of conv context kept beyond the derived reach: guards a mis-modelled layer, not needed when exact.
CONTEXT_MARGIN_FRAMES = 1


@contextlib.contextmanager
def native_cpu_convs():
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


@dataclass(frozen=True)
class StreamState:
    kv: torch.Tensor  # [layers, 2, kv_heads, W, head_dim] post-rope K/V of the last W = min(position, window-1) frames
    hidden: torch.Tensor  # [C', hidden] pre-transformer outputs of the last C' = min(position, C) frames
    position: int  # frames decoded so far


ChunkIn = tuple[torch.Tensor, "StreamState | None"]  # codes [n, Q] int, state (None: a new stream)
ChunkOut = tuple[torch.Tensor, StreamState]  # float32 [samples], state after the chunk


def conv_reach_frames(module: torch.nn.Module, samples_per_frame: int, tail_samples: int) -> int:
    """Fewest leading frames C whose samples the chunk may drop such that the first sample it emits
    (local index C * spf - tail) depends only on real frames, not on the zero left padding."""
    layers = []
    for part in (module.upsample, module.decoder):
        for m in part.modules():
            if isinstance(m, (Qwen3OmniMoeCausalConvNet, Qwen3OmniMoeCausalTransConvNet)):
                layers.append(m)
            elif isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) and not any(m is x.conv for x in layers):
                raise RuntimeError(f"code2wav conv stack has an unmodelled conv {m}")

    def first_input(layer: torch.nn.Module, i: int) -> int:  # lowest input index output i depends on
        conv = layer.conv
        if conv.padding != (0,) or (isinstance(layer, Qwen3OmniMoeCausalTransConvNet) and conv.dilation != (1,)):
            raise RuntimeError(f"code2wav conv geometry unsupported: {conv}")
        if isinstance(layer, Qwen3OmniMoeCausalConvNet):  # left pad `padding`, effective kernel `kernel_size`
            return i * layer.stride - layer.padding
        # Transposed: input j feeds uncropped outputs [j*s, j*s + k - 1]; the left crop shifts by left_pad.
        k, s = conv.kernel_size[0], conv.stride[0]
        return -((k - 1 - i - layer.left_pad) // s)  # ceil((i + left_pad - k + 1) / s)

    def first_frame(sample: int) -> int:
        for layer in reversed(layers):
            sample = first_input(layer, sample)
        return sample

    reach = 0
    while first_frame(reach * samples_per_frame - tail_samples) < 0:
        reach += 1
        if reach > 10_000:
            raise RuntimeError("code2wav conv reach not found")
    return reach


def chunk_key(codes: torch.Tensor, state: StreamState | None) -> tuple[int, int, int]:
    """(W, n, C'): the carried K/V frames, the new frames and the carried conv-context rows of a chunk. Chunks
    of one key run as one forward, and lower keys have decoded less: a stream's first chunk is (0, n, 0)."""
    if state is None:
        return 0, int(codes.shape[0]), 0
    return int(state.kv.shape[3]), int(codes.shape[0]), int(state.hidden.shape[0])


def take_group(items: list, key, limit: int) -> tuple[list, list]:
    """Splits queued chunks into the next forward's group, the oldest `limit` of those with the lowest
    key(item), and the rest in their order. A serving loop that takes one group at a time, and adds what
    arrived meanwhile before it takes the next, runs a stream's first chunk after at most one forward."""
    lowest = min(key(item) for item in items)
    group, rest = [], []
    for item in items:
        (group if len(group) < limit and key(item) == lowest else rest).append(item)
    return group, rest


def _last(t: torch.Tensor, dim: int, keep: int) -> torch.Tensor:
    return t.narrow(dim, max(0, t.shape[dim] - keep), min(keep, t.shape[dim]))


class _ChunkCache:
    """Duck-typed transformers Cache for one batched chunk: each attention layer calls update() once and
    attends to the carried K/V followed by its new rows."""

    def __init__(self, past: torch.Tensor):
        self.past = past  # [B, layers, 2, kv_heads, W, head_dim]
        self.full: list[torch.Tensor] = []  # per layer [B, 2, kv_heads, W + n, head_dim]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        assert layer_idx == len(self.full), "code2wav layers must run in order"
        k = torch.cat([self.past[:, layer_idx, 0], key_states], dim=2)
        v = torch.cat([self.past[:, layer_idx, 1], value_states], dim=2)
        self.full.append(torch.stack([k, v], dim=1))
        return k, v


class Code2WavRunner:
    def __init__(self, module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype,
                 context_frames: int | None = None):
        # As Code2WavRunner: the module comes loaded in `dtype` (casting here would also cast rope's inv_freq).
        param_dtype = next(module.parameters()).dtype
        if param_dtype != dtype:
            raise ValueError(f"code2wav module is {param_dtype}, expected {dtype}; load it in that dtype")
        config = module.config
        if any(t != "sliding_attention" for t in config.layer_types):
            raise ValueError(f"code2wav streaming needs sliding-window layers only, got {config.layer_types}")
        self.attn_impl = config._attn_implementation
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"code2wav streaming supports sdpa and eager attention, got {self.attn_impl}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.module = module.to(self.device).eval()
        self.num_quantizers = int(config.num_quantizers)
        self.codebook_size = int(config.codebook_size)
        self.hidden_size = int(config.hidden_size)
        self.window = int(config.sliding_window)
        self.layers = list(module.pre_transformer.layers[: config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.kv_frames = self.window - 1  # keys a new query can still see: q - window < k < first new
        # Measured, as in Code2WavRunner: output length = frames * samples_per_frame - tail.
        zeros = torch.zeros(1, self.num_quantizers, 2, dtype=torch.long, device=self.device)
        with torch.inference_mode(), self._convs():
            len1, len2 = (self.module(zeros[..., :t]).shape[-1] for t in (1, 2))
        self.samples_per_frame = len2 - len1  # 1920 for Qwen3-Omni
        self.tail_samples = self.samples_per_frame - len1  # 555
        self.conv_reach = conv_reach_frames(module, self.samples_per_frame, self.tail_samples)  # 10 for Qwen3-Omni
        self.context_frames = self.conv_reach + CONTEXT_MARGIN_FRAMES if context_frames is None else context_frames
        self.forwards = 0  # forwards run: a batch of chunks with k distinct (n, W, C') shapes takes k
        if self.context_frames < 1:  # a chunk after the first must re-emit the previous chunk's missing tail
            raise ValueError(f"context_frames must be >= 1, got {self.context_frames}")

    def output_samples(self, frames: int, position: int) -> int:
        """Samples decode() returns for a chunk of `frames` frames after `position` decoded frames."""
        return frames * self.samples_per_frame - (self.tail_samples if position == 0 else 0)

    def new_samples_start(self, context_rows: int) -> int:
        """Where a chunk's own audio starts in the conv stack's output over its context_rows carried rows and
        its new frames: the carried rows' samples were the previous chunk's, bar the tail it could not emit."""
        return context_rows * self.samples_per_frame - self.tail_samples if context_rows else 0

    def check(self, codes: torch.Tensor, state: StreamState | None) -> None:
        """The checks of one chunk that need no device sync (types, shapes, the state's consistency): a
        serving loop runs them as requests arrive, without waiting for the decode in flight on the device."""
        self._check(codes, state)

    def range_errors(self, codes: list[torch.Tensor]) -> list[str | None]:
        """Per chunk, why its codes are out of range, or None; one device sync for all of them (none for host
        codes). A serving loop turns the bad chunks of a batch away on their own instead of failing the batch
        with them."""
        if not codes:
            return []
        pairs = [torch.stack([c.min(), c.max()]) for c in codes]
        if any(p.device.type != "cpu" for p in pairs):  # host codes (as served) need no device at all
            pairs = [p.to(self.device) for p in pairs]
        bounds = torch.stack(pairs).tolist()
        return [None if lo >= 0 and hi < self.codebook_size
                else f"codes must be in [0, {self.codebook_size}), got values in [{lo}, {hi}]" for lo, hi in bounds]  # fmt: skip

    @torch.inference_mode()
    def decode(self, chunks: list[ChunkIn]) -> list[ChunkOut]:
        out: list[ChunkOut | None] = [None] * len(chunks)
        for done in self.decode_groups(chunks):
            for i, result in done:
                out[i] = result
        return out

    @torch.inference_mode()  # on a generator function torch enters the mode around each step
    def decode_groups(self, chunks: list[ChunkIn], check_ranges: bool = True) -> Iterator[list[tuple[int, ChunkOut]]]:
        """decode(), one forward at a time: yields (chunk index, result) for each group of chunks of one
        shape as soon as its forward is queued, streams' first chunks first (they decide the time to first
        audio and are the cheapest), so a serving loop can answer them before the rest of the batch.
        Checks every chunk before any forward runs; check_ranges=False skips the value ranges (and their
        device sync) for a caller that has just run range_errors() on these chunks."""
        states: list[StreamState] = []
        groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)  # chunk_key -> chunk indices
        for i, (codes, state) in enumerate(chunks):
            try:
                states.append(self._check(codes, state))
            except BadRequestError as e:
                raise BadRequestError(f"code2wav chunk {i}: {e}") from None
            groups[chunk_key(codes, states[-1])].append(i)
        # Value ranges with one host sync, before any forward runs.
        for i, error in enumerate(self.range_errors([codes for codes, _ in chunks]) if check_ranges else ()):
            if error is not None:
                raise BadRequestError(f"code2wav chunk {i}: {error}")
        for key in sorted(groups):  # least decoded so far first
            idx = groups[key]
            _, n, context = key
            group_states = [states[i] for i in idx]
            codes = torch.stack([chunks[i][0].to(self.device, torch.long) for i in idx])  # [B, n, Q]
            wav, kv, hidden = self._forward(codes, group_states)
            self.forwards += 1
            first = self.new_samples_start(context)
            # Audio: a view of the batch output (the caller copies it out). State: own storage, so one
            # stream's state does not keep the whole batch alive.
            yield [(i, (wav[row, first:].float(), StreamState(kv[row].clone(), hidden[row].clone(), s.position + n)))
                   for row, (i, s) in enumerate(zip(idx, group_states))]  # fmt: skip

    def _forward(self, codes: torch.Tensor, states: list[StreamState]):
        # codes [B, n, Q]; states share W and C'.
        # Returns wav [B, (C' + n) * spf - tail] and the next states' kv [B, L, 2, H, W', D], hidden [B, C'', D].
        past_kv = torch.stack([s.kv.to(self.device, self.dtype) for s in states])  # [B, L, 2, H, W, D]
        past_hidden = torch.stack([s.hidden.to(self.device, self.dtype) for s in states])  # [B, C', D]
        position = to_device([s.position for s in states], self.device)[:, None]  # [B, 1], without a wait
        return self._forward_tensors(codes, past_kv, past_hidden, position)

    def forward_first(self, codes: torch.Tensor):
        """_forward for new streams' first chunks, codes [B, n, Q] on the device: nothing but device work, so
        it can be captured as a CUDA graph (code2wav_first.py)."""
        b = codes.shape[0]
        past_kv = torch.zeros(b, len(self.layers), 2, self.kv_heads, 0, self.head_dim, dtype=self.dtype,
                              device=self.device)  # fmt: skip
        past_hidden = torch.zeros(b, 0, self.hidden_size, dtype=self.dtype, device=self.device)
        position = torch.zeros(b, 1, dtype=torch.long, device=self.device)
        return self._forward_tensors(codes, past_kv, past_hidden, position)

    def _forward_tensors(self, codes, past_kv, past_hidden, position):
        hidden, kv = self.transformer(codes, past_kv, position)
        hidden = torch.cat([past_hidden, hidden], dim=1)  # [B, C' + n, D]
        wav = self.conv_stack(hidden)
        return wav, _last(kv, 4, self.kv_frames), _last(hidden, 1, self.context_frames)

    def transformer(self, codes: torch.Tensor, past_kv: torch.Tensor, position: torch.Tensor):
        """The pre-transformer on a chunk's new frames, codes [B, n, Q], after `position` [B, 1] decoded frames
        whose post-rope K/V are the last rows of past_kv [B, L, 2, H, W, D]. Rows of past_kv that would sit
        before frame 0 (a stream with position < W, its K/V right-aligned) are masked out, so a batch can
        carry streams of any position in one W. Returns the normed outputs [B, n, D] and every layer's K/V
        [B, L, 2, H, W + n, D]."""
        n = codes.shape[1]
        m = self.module
        past = past_kv.shape[4]

        hidden = m.code_embedding(codes.transpose(1, 2) + m.code_offset).mean(1)  # [B, n, D]
        position_ids = position + torch.arange(n, device=self.device)  # [B, n]
        key_pos = position - past + torch.arange(past + n, device=self.device)  # [B, W + n]
        q, k = position_ids[:, None, :, None], key_pos[:, None, None, :]
        # [B, 1, n, W + n]: transformers' sliding-window rule, and no key before the stream's first frame
        mask = (k <= q) & (k > q - self.window) & (k >= 0)
        if self.attn_impl == "eager":  # eager adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        cache = _ChunkCache(past_kv)
        rope = m.pre_transformer.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=position_ids,
                           past_key_values=cache, use_cache=True)
        return m.pre_transformer.norm(hidden), torch.stack(cache.full, dim=1)

    def conv_stack(self, hidden: torch.Tensor) -> torch.Tensor:
        # [B, T, D] pre-transformer outputs -> [B, T * spf - tail] samples, as the module's forward.
        with self._convs():
            wav = hidden.transpose(1, 2)  # [B, D, T]
            for blocks in self.module.upsample:
                for block in blocks:
                    wav = block(wav)
            for block in self.module.decoder:
                wav = block(wav)
        return wav.clamp(min=-1, max=1)[:, 0]

    def _convs(self):
        return native_cpu_convs() if self.device.type == "cpu" else contextlib.nullcontext()

    def _check(self, codes: object, state: object) -> StreamState:
        if not isinstance(codes, torch.Tensor):
            raise BadRequestError(f"codes must be a tensor, got {type(codes).__name__}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise BadRequestError(f"codes must be integers, got {codes.dtype}")
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers or codes.shape[0] < 1:
            raise BadRequestError(f"codes must be [frames >= 1, {self.num_quantizers}], got {list(codes.shape)}")
        if state is None:
            return StreamState(
                torch.empty(len(self.layers), 2, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device),
                torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device),
                0,
            )
        if not isinstance(state, StreamState):
            raise BadRequestError(f"state must be a StreamState or None, got {type(state).__name__}")
        try:
            if isinstance(state.position, bool):
                raise TypeError
            position = operator.index(state.position)
        except TypeError:
            raise BadRequestError(f"state position must be an int, got {state.position!r}") from None
        if position < 0:
            raise BadRequestError(f"state position must be >= 0, got {position}")
        for name, t, shape in (
            ("kv", state.kv, [len(self.layers), 2, self.kv_heads, min(position, self.kv_frames), self.head_dim]),
            ("hidden", state.hidden, [min(position, self.context_frames), self.hidden_size]),
        ):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise BadRequestError(f"state {name} must be a float tensor")
            if list(t.shape) != shape:
                raise BadRequestError(f"state {name} must be {shape} after {position} frames, got {list(t.shape)}")
        return StreamState(state.kv, state.hidden, position)
