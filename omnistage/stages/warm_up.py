# The synthetic prompts a stage serves before it reports ready (DecoderRunner.warm_up): a short text turn,
# and a turn with a 5 s clip, one with a 448x448 picture (W3's and W4's geometry) and one with a short video,
# so the audio and vision encoders (on pictures and on frames), the batched media prefill and the talker's
# prompts from media turns load and pick their kernels before the first request, not while it waits.
# Zero-valued media: what is warmed depends on the shapes only; a video's own kernels (the vision encoder's
# per-frame attention, its MRoPE positions) load with any length of it, so its clip is kept short.
from __future__ import annotations

from dataclasses import dataclass

import torch

from .audio_encoder import encoded_length

NEWLINE, WORD = 198, 1000  # "\n" and an ordinary token of the Qwen vocabulary
AUDIO_FRAMES = 500  # mel frames of a 5 s clip (100 per second)
IMAGE_GRID = (1, 28, 28)  # a 448x448 picture in 16-pixel patches
VIDEO_GRID = (2, 8, 8)  # four 128x128 frames: two temporal patches of two frames each
VIDEO_SECONDS_PER_GRID = 1.0  # two frames at 2 fps per temporal patch


@dataclass
class WarmUpTurn:
    ids: list[int]  # the thinker prompt: the user turn and the assistant header
    input_features: torch.Tensor | None = None  # [1, mels, AUDIO_FRAMES]
    feature_attention_mask: torch.Tensor | None = None  # [1, AUDIO_FRAMES]
    pixel_values: torch.Tensor | None = None  # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None  # [1, 3]
    pixel_values_videos: torch.Tensor | None = None  # [patches, C*T*P*P]
    video_grid_thw: torch.Tensor | None = None  # [1, 3]
    video_second_per_grid: torch.Tensor | None = None  # [1]

    def user_ids(self) -> torch.Tensor:
        """The user turn's ids as the thinker hands them to the talker (all but the assistant header)."""
        return torch.tensor(self.ids[:-3])


def warm_up_turns(config) -> list[WarmUpTurn]:
    """A text turn, an audio turn, an image turn and a video turn of the model `config` (Qwen3OmniMoeConfig)."""
    c, t = config, config.thinker_config
    head, tail = [c.im_start_token_id, c.user_token_id, NEWLINE], [c.im_end_token_id, NEWLINE]
    assistant = [c.im_start_token_id, c.assistant_token_id, NEWLINE]
    words = [WORD] * 8
    audio_tokens = encoded_length(AUDIO_FRAMES, t.audio_config.n_window)
    v = t.vision_config
    patches = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2]
    image_tokens = patches // v.spatial_merge_size**2
    frames = VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2]
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    return [
        WarmUpTurn(head + words + tail + assistant),
        WarmUpTurn(head + [t.audio_start_token_id] + [t.audio_token_id] * audio_tokens + [t.audio_end_token_id]
                   + words + tail + assistant,
                   input_features=torch.zeros(1, t.audio_config.num_mel_bins, AUDIO_FRAMES),
                   feature_attention_mask=torch.ones(1, AUDIO_FRAMES, dtype=torch.long)),
        WarmUpTurn(head + [t.vision_start_token_id] + [t.image_token_id] * image_tokens + [t.vision_end_token_id]
                   + words + tail + assistant,
                   pixel_values=torch.zeros(patches, patch, dtype=torch.uint8), image_grid_thw=torch.tensor([IMAGE_GRID])),
        WarmUpTurn(head + [t.vision_start_token_id] + [t.video_token_id] * (frames // v.spatial_merge_size**2)
                   + [t.vision_end_token_id] + words + tail + assistant,
                   pixel_values_videos=torch.zeros(frames, patch, dtype=torch.uint8), video_grid_thw=torch.tensor([VIDEO_GRID]),
                   video_second_per_grid=torch.tensor([VIDEO_SECONDS_PER_GRID])),
    ]  # fmt: skip
