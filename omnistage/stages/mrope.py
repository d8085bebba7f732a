# MRoPE positions of one prompt with media, as transformers' get_rope_index computes them (it stays the
# oracle: tests/unit/test_mrope.py). Its walk over the prompt's items is kept step for step, quirks
# included (the talker calls it without use_audio_in_video on prompts whose video and audio rows
# interleave, and generate() gets those positions), but a video's frames and its audio track are merged
# in one stable sort rather than a loop over single tokens: for a 10 s clip with its audio that loop made
# ~12,000 scalar tensor ops, 22 ms of host time under the GIL per prompt at admission.
from __future__ import annotations

import torch

from .audio_encoder import encoded_length


class MropeIndex:
    def __init__(self, model, n_window: int):
        """`model`: transformers' thinker or talker (its config's token ids and position_id_per_seconds, its
        spatial_merge_size), the model whose get_rope_index this computes; n_window: the audio encoder's
        (the thinker's audio config has it, the talker's config none)."""
        c = model.config
        self.merge = model.spatial_merge_size
        self.image_id, self.video_id, self.audio_id = c.image_token_id, c.video_token_id, c.audio_token_id
        self.vision_start_id, self.audio_start_id = c.vision_start_token_id, c.audio_start_token_id
        self.per_second = c.position_id_per_seconds
        self.n_window = n_window

    def __call__(self, ids: torch.Tensor, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                 use_audio_in_video: bool, audio_lengths: torch.Tensor | None,
                 second_per_grid: torch.Tensor | None) -> tuple[torch.Tensor, int]:  # fmt: skip
        """Positions [3, L] (float32) and rope delta of one prompt's ids [L] (host tensors; audio_lengths:
        each clip's mel frames)."""
        tokens = ids.tolist()
        starts = [i for i, t in enumerate(tokens) if t == self.vision_start_id]
        after = [tokens[i + 1] for i in starts]
        audios = tokens.count(self.audio_start_id)
        images = after.count(self.image_id)
        videos = after.count(self.audio_start_id) if use_audio_in_video else after.count(self.video_id)
        has_vision = self.image_id in tokens or self.video_id in tokens
        has_audio = self.audio_id in tokens
        pieces: list[torch.Tensor] = []  # [3, n] each
        st = 0
        image_idx = video_idx = audio_idx = 0
        for _ in range(images + audios + (0 if use_audio_in_video else videos)):
            st_idx = pieces[-1].max() + 1 if pieces else 0
            vision_at = tokens.index(self.vision_start_id, st) if has_vision and (videos > 0 or images > 0) else len(tokens) + 1
            audio_at = tokens.index(self.audio_start_id, st) if has_audio and audios > 0 else len(tokens) + 1
            at = min(vision_at, audio_at)
            text_len = at - st
            if text_len:
                pieces.append(_line(text_len) + st_idx)
                st_idx += text_len
            both = at == vision_at and vision_at + 1 == audio_at  # a video with its audio track
            edge = 2 if both else 1  # rows of its start (and of its end) markers
            pieces.append(_line(edge) + st_idx)
            st_idx += edge
            if at == audio_at:
                n = encoded_length(int(audio_lengths[audio_idx]), self.n_window)
                pieces.append(_line(n) + st_idx)
                st += text_len + edge + n + edge
                audio_idx, audios = audio_idx + 1, audios - 1
            elif tokens[at + 1] == self.image_id:
                times = (torch.arange(image_grid_thw[image_idx][0]) * self.per_second).float()
                pieces.append(self._vision(image_grid_thw, image_idx, times, st_idx))
                st += text_len + edge + self._vision_tokens(image_grid_thw[image_idx]) + edge
                image_idx, images = image_idx + 1, images - 1
            elif tokens[at + 1] == self.video_id:
                pieces.append(self._vision(video_grid_thw, video_idx, self._video_times(video_grid_thw, second_per_grid,
                                                                                        video_idx), st_idx))  # fmt: skip
                st += text_len + edge + self._vision_tokens(video_grid_thw[video_idx]) + edge
                video_idx, videos = video_idx + 1, videos - 1
            elif both:
                n = encoded_length(int(audio_lengths[audio_idx]), self.n_window)
                audio = _line(n) + st_idx
                video = self._vision(video_grid_thw, video_idx, self._video_times(video_grid_thw, second_per_grid,
                                                                                  video_idx), st_idx)  # fmt: skip
                pieces += _interleave(video, audio)
                st += text_len + edge + n + self._vision_tokens(video_grid_thw[video_idx]) + edge
                audio_idx, video_idx, audios, videos = audio_idx + 1, video_idx + 1, audios - 1, videos - 1
            st_idx = pieces[-1].max() + 1 if pieces else 0
            pieces.append(_line(edge) + st_idx)
        if st < len(tokens):
            st_idx = pieces[-1].max() + 1 if pieces else 0
            pieces.append(_line(len(tokens) - st) + st_idx)
        positions = torch.cat([p.float() for p in pieces], dim=1)
        return positions, int(positions.max() + 1 - len(tokens))

    # ---- internals ----------------------------------------------------------------------------------------
    def _vision_tokens(self, grid: torch.Tensor) -> int:
        return int(grid.prod() // self.merge**2)

    def _video_times(self, grid: torch.Tensor, second_per_grid: torch.Tensor, i: int) -> torch.Tensor:
        return (torch.arange(grid[i][0]) * second_per_grid[i].float() * self.per_second).float()

    def _vision(self, grid: torch.Tensor, i: int, t_index: torch.Tensor, start) -> torch.Tensor:
        """[3, t*h*w] temporal, height and width positions of one image or video's merged patches."""
        h, w = int(grid[i][1]) // self.merge, int(grid[i][2]) // self.merge
        hs = torch.arange(h).view(1, -1, 1).expand(len(t_index), -1, w).flatten().float()
        ws = torch.arange(w).view(1, 1, -1).expand(len(t_index), h, -1).flatten().float()
        ts = t_index.view(-1, 1).expand(-1, h * w).flatten().float()
        return torch.stack([ts, hs, ws]) + start


def _line(n) -> torch.Tensor:
    """[3, n]: 0..n-1 in every section."""
    return torch.arange(n).view(1, -1).expand(3, -1)


def _interleave(video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """A video's positions [3, V] and its audio track's [3, A] in get_rope_index's order: a merge by temporal
    position, a frame's rows before audio rows of the same time (a stable sort of the frames then the audio).
    As two pieces, so that the last one is the block get_rope_index appends last (its max starts the end
    marker): the rows after the last row of the kind that ran out first."""
    if not video.shape[1] or not audio.shape[1]:
        return [x for x in (video, audio) if x.shape[1]]
    both = torch.cat([video.float(), audio.float()], dim=1)
    order = torch.sort(both[0], stable=True).indices
    merged = both[:, order]
    is_video = order < video.shape[1]
    other = (is_video != is_video[-1]).nonzero()
    cut = int(other[-1]) + 1
    return [merged[:, :cut], merged[:, cut:]]
