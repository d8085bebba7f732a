# The thinker's vision encoder (transformers' Qwen3OmniMoeVisionEncoder, its weights) over every image of
# a prefill step in one pass. Patch embedding, the learned position table resampled to each image's grid,
# the 2D rotary angles and the MLPs are per patch, so they run on all images' patches at once; attention
# is full within each frame of each image (transformers' cu_seqlens), one call per block over all frames
# (stages/packed_attention.py) where transformers' sdpa path loops over them. The deepstack mergers'
# outputs after the blocks listed in deepstack_visual_indexes feed the thinker's first layers.
from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import rotate_half
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from ..models import fused_ops
from ..models.pixels import scale_pixels
from .host_copy import to_device
from .packed_attention import Segments, attend


class VisionEncoder:
    def __init__(self, visual, pixel_table: torch.Tensor):
        self.visual = visual  # transformers' Qwen3OmniMoeVisionEncoder
        self.pixel_table = pixel_table  # models/pixels.py; moved to the encoder's device on first use
        self.merge = visual.spatial_merge_size
        self.deepstack_layers = list(visual.config.deepstack_visual_indexes)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """pixels [patches, C*T*P*P] uint8 of all images in order, grid_thw [images, 3] (host). Returns the image
        tokens packed in image order [sum n_i, out_hidden], the deepstack features (one [sum n_i, out_hidden]
        per deepstack layer) and n_i per image (patches / merge^2)."""
        v = self.visual
        device = v.patch_embed.proj.weight.device
        grid_thw = grid_thw.cpu()
        taps, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, v.num_grid_per_side, mode=v.interpolation_mode, align_corners=v.interpolation_align_corners,
            spatial_merge_size=self.merge)  # fmt: skip
        positions = get_vision_position_ids(grid_thw, self.merge)  # [patches, 2]: row, column
        frames = Segments(torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist(), device)

        self.pixel_table = self.pixel_table.to(device)
        hidden = v.patch_embed(scale_pixels(to_device(pixels, device), self.pixel_table))  # [patches, hidden]
        taps, weights, positions = (to_device(t, device) for t in (taps, weights, positions))
        hidden = hidden + (v.pos_embed(taps) * weights[:, :, None]).sum(1).to(hidden.dtype)
        cos, sin = v.rotary_pos_emb(hidden, positions)
        deepstack = []
        for i, block in enumerate(v.blocks):
            hidden = hidden + self._attention(block.attn, block.norm1(hidden), cos, sin, frames)
            hidden = hidden + block.mlp(block.norm2(hidden))
            if i in self.deepstack_layers:
                deepstack.append(v.merger_list[self.deepstack_layers.index(i)](hidden))
        counts = (grid_thw.prod(-1) // self.merge**2).tolist()
        return v.merger(hidden), deepstack, counts

    @staticmethod
    def _attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments) -> torch.Tensor:
        qkv = attn.qkv(x).view(x.shape[0], 3, attn.num_heads, -1)  # [patches, 3, H, hd]
        q, k = rotate_qk(qkv[:, :2], cos, sin).unbind(1)
        return attn.proj(attend(q, k, qkv[:, 2], frames, attn.scaling))


def rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision over q and k at once: qk [N, 2, H, hd], cos / sin [N, hd].
    The same float32 operations on every element; on CUDA in one kernel (fused_ops.vision_rope)."""
    if qk.is_cuda and fused_ops.available():
        return fused_ops.vision_rope(qk, cos, sin)
    x, cos, sin = qk.float(), cos[:, None, None].float(), sin[:, None, None].float()
    return ((x * cos) + (rotate_half(x) * sin)).to(qk.dtype)
