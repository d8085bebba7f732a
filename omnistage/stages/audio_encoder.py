# The thinker's audio encoder (transformers' Qwen3OmniMoeAudioEncoder, its weights) over every clip of a
# prefill step in one pass: one conv stack over all clips' chunks, one attention call per layer over all
# clips' windows (stages/packed_attention.py), where transformers' sdpa path loops over windows.
#
# What one clip computes, as transformers does for a clip alone: its mel frames are cut into chunks of
# 2 * n_window frames (the last one shorter), each chunk goes through three stride-2 convs on its own,
# the valid positions of all chunks are concatenated (13 per full chunk) and the encoder layers attend
# within windows of n_window_infer frames' worth of them. A clip alone pads its chunks to its longest
# chunk, so the last chunk of a clip longer than one chunk sees the padding's conv outputs at its edge
# while a one-chunk clip sees the convs' zero padding. Here every chunk is padded to a full chunk and,
# for one-chunk clips, each conv's output past the clip's own length is zeroed: each clip gets what it
# gets alone, whatever it is batched with.
from __future__ import annotations

import torch
import torch.nn.functional as F

from .host_copy import to_device
from .packed_attention import Segments, attend


def conv_length(frames: int) -> int:
    """Positions a chunk of `frames` mel frames keeps after one stride-2 conv (kernel 3, padding 1)."""
    return (frames - 1) // 2 + 1


def encoded_length(frames: int, n_window: int) -> int:
    """Audio tokens of a clip of `frames` mel frames (transformers' _get_feat_extract_output_lengths)."""
    chunk = 2 * n_window
    full, tail = divmod(frames, chunk)
    return full * conv_length(conv_length(conv_length(chunk))) + (
        conv_length(conv_length(conv_length(tail))) if tail else 0
    )


class AudioEncoder:
    def __init__(self, tower):
        self.tower = tower  # transformers' Qwen3OmniMoeAudioEncoder
        cfg = tower.config
        self.chunk = 2 * cfg.n_window  # mel frames per chunk
        self.chunk_tokens = conv_length(conv_length(conv_length(self.chunk)))
        # a window holds this many full chunks' tokens (transformers: max chunk tokens * n_window_infer / chunk)
        self.window = self.chunk_tokens * (cfg.n_window_infer // self.chunk)
        self.convs = (tower.conv2d1, tower.conv2d2, tower.conv2d3)

    @torch.inference_mode()
    def __call__(self, clips: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """clips: each clip's valid mel frames [mels, frames_i] (host or device). Returns the audio tokens of
        all clips, packed in clip order [sum n_i, output_dim], and n_i per clip."""
        device, dtype = self.tower.conv2d1.weight.device, self.tower.conv2d1.weight.dtype
        chunks, own, counts, windows, valid = [], [], [], [], []
        for clip in clips:
            frames = clip.shape[1]
            pieces = list(clip.split(self.chunk, dim=1))
            chunks += pieces
            # the width this clip pads its chunks to when alone (see the header)
            own += [self.chunk if len(pieces) > 1 else frames] * len(pieces)
            tokens = [conv_length(conv_length(conv_length(p.shape[1]))) for p in pieces]
            valid += tokens
            counts.append(sum(tokens))
            windows += [self.window] * (counts[-1] // self.window) + ([counts[-1] % self.window] if counts[-1] % self.window else [])
        grid = torch.zeros(len(chunks), clips[0].shape[0], self.chunk, dtype=clips[0].dtype, device=clips[0].device)
        for i, piece in enumerate(chunks):
            grid[i, :, : piece.shape[1]] = piece
        hidden = self._convs(to_device(grid, device).to(dtype), own)
        # valid positions of each chunk, in clip order: [N, d_model]
        index = [c * self.chunk_tokens + j for c, n in enumerate(valid) for j in range(n)]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, to_device(index, device))
        hidden = self._layers(hidden, Segments(windows, device))
        t = self.tower
        return t.proj2(t.act(t.proj1(t.ln_post(hidden)))), counts

    def _convs(self, grid: torch.Tensor, own: list[int]) -> torch.Tensor:
        """grid [chunks, mels, chunk] -> [chunks, chunk_tokens, d_model] with positions added."""
        x, lengths = grid[:, None], torch.tensor(own)
        for conv in self.convs:
            x = F.gelu(conv(x))  # [chunks, C, mels', time']
            lengths = (lengths - 1) // 2 + 1
            keep = torch.arange(x.shape[-1])[None] < lengths[:, None]  # [chunks, time']
            x = x * to_device(keep, x.device)[:, None, None].to(x.dtype)
        b, c, f, t = x.shape
        x = self.tower.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        return x + self.tower.positional_embedding.positional_embedding[:t].to(x.dtype)

    def _layers(self, hidden: torch.Tensor, windows: Segments) -> torch.Tensor:
        for layer in self.tower.layers:
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(hidden)
            q, k, v = (p(x).view(x.shape[0], attn.num_heads, attn.head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            hidden = hidden + attn.out_proj(attend(q, k, v, windows, attn.scaling))
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden))))
        return hidden
