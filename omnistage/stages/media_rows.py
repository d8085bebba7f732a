# A thinker prompt's rows as its prefill forward takes them: input embeddings with the media encoders'
# tokens in place, MRoPE positions, the deepstack rows of its image and video tokens and where its media
# rows are. What transformers' thinker forward does to its inputs before the decoder layers, done for all
# prompts of a step at once: every clip (audio parts, and the audio tracks of videos taken with
# use_audio_in_video) through the audio encoder in one call and every image and video through the vision
# encoder in one call (audio_encoder.py, vision_encoder.py), each encoder's tokens scattered at its
# placeholder rows in prompt order (as the forward's masked_scatter does: the processor lays items out in
# the order their features come, and with use_audio_in_video a video's clip interleaves with its frames,
# the two kinds' rows still each in order). A prompt's rows may start after a kept prefix: only the items
# whose rows lie after it are encoded (an item never straddles the cut, see media_prefix_cache.py).
# Positions are get_rope_index's of the whole prompt (mrope.py), derived at admission (rope_index).
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.errors import BadRequestError
from ..models.processor import load_pixel_table
from .audio_encoder import AudioEncoder, encoded_length
from .host_copy import to_device
from .mrope import MropeIndex


@dataclass
class InputRows:
    """Rows of one prompt for a prefill forward, from some position of it on."""

    embeds: torch.Tensor  # [T, D] input embeddings on the device
    positions: torch.Tensor | None = None  # [3, T] MRoPE positions on the host; None: text from the row's start
    rope_delta: int = 0
    deepstack: tuple[torch.Tensor, torch.Tensor] | None = None  # image/video rows [k] (host), features [layers, k, D]
    media: torch.Tensor | None = None  # host: rows [m] of media tokens (audio, image, video)

    def cut(self, a: int, b: int) -> InputRows:
        """Rows [a, b) of these, positions and row numbers taken along (row numbers from a)."""
        deepstack = media = None
        if self.deepstack is not None:
            rows, features = self.deepstack
            inside = ((rows >= a) & (rows < b)).nonzero().squeeze(1)
            deepstack = (rows[inside] - a, features[:, to_device(inside, features.device)])
        if self.media is not None:
            media = self.media[(self.media >= a) & (self.media < b)] - a
        positions = self.positions[:, a:b] if self.positions is not None else None
        return replace(self, embeds=self.embeds[a:b], positions=positions, deepstack=deepstack, media=media)


class MediaInputs:
    def __init__(self, thinker, pixel_table: torch.Tensor | None = None):
        """pixel_table: what the processor's pixel bytes stand for (models/processor.load_pixel_table); the
        released preprocessor settings' when not given."""
        from .vision_encoder import VisionEncoder  # transformers' vision helpers: imported with the runner

        if pixel_table is None:
            pixel_table = load_pixel_table("dummy:")
        self.thinker = thinker  # transformers' thinker: its embedding and its encoders' weights
        self.audio, self.vision = AudioEncoder(thinker.audio_tower), VisionEncoder(thinker.visual, pixel_table)
        self.n_window, self.merge = thinker.audio_tower.config.n_window, thinker.visual.spatial_merge_size
        c = thinker.config
        self.audio_id, self.image_id, self.video_id = c.audio_token_id, c.image_token_id, c.video_token_id
        self.mm_ids = torch.tensor([self.audio_id, self.image_id, self.video_id])
        self.mrope = MropeIndex(thinker, self.n_window)

    def validate(self, p) -> None:
        """A prompt whose placeholder counts differ from its media's token counts is the client's error (the
        processor never makes one); found at admission, so it fails no other prompt of a step."""
        ids = p.input_ids.cpu()
        for what, counts, placeholder in (("audio", self._clip_tokens(p), self.audio_id),
                                          ("image", self._vision_tokens(p.image_grid_thw), self.image_id),
                                          ("video", self._vision_tokens(p.video_grid_thw), self.video_id)):  # fmt: skip
            have, want = int((ids == placeholder).sum()), sum(counts)
            if have != want:
                raise BadRequestError(f"prompt has {have} {what} placeholder tokens for {want} {what} tokens")

    def rope_index(self, p) -> tuple[torch.Tensor, int]:
        """MRoPE positions [3, L] and rope delta of one prompt, as transformers' forward computes them
        (mrope.py; for a text-only prompt 0..L-1 on every section, delta 0); the prompt's own when its
        admission derived them."""
        if p.is_text_only:
            return torch.arange(p.input_ids.numel()).expand(3, -1), 0
        if p.rope is not None:
            return p.rope
        lengths = p.feature_attention_mask.cpu().sum(-1) if p.feature_attention_mask is not None else None
        return self.mrope(p.input_ids.cpu(), _host(p.image_grid_thw), _host(p.video_grid_thw), p.use_audio_in_video,
                          lengths, _host(p.video_second_per_grid))  # fmt: skip

    @torch.inference_mode()
    def rows(self, prompts: list, starts: list[int]) -> list[InputRows]:
        """Each prompt's rows from its start on (prompts: ThinkerPrompts, ids and media on the host), every
        clip of them through the audio encoder in one call, every image and video through the vision
        encoder in one call."""
        ids = [p.input_ids.cpu()[a:] for p, a in zip(prompts, starts)]
        embeds = self.thinker.get_input_embeddings()(to_device(torch.cat(ids), self.thinker.device))
        embeds = list(embeds.split([x.numel() for x in ids]))  # [T_i, D] each
        items = [self._items_after(p, a) for p, a in zip(prompts, starts)]
        clips = [c for clips, _, _ in items for c in clips]
        patches = [x for _, patches, _ in items for x in patches]
        audio = self.audio(clips)[0] if clips else None
        vision = deepstack = None
        if patches:
            vision, deepstack, _ = self.vision(torch.cat(patches), torch.cat([g for *_, grids in items for g in grids]))
            deepstack = torch.stack(deepstack)  # [layers, tokens, D]
        taken = {"audio": 0, "vision": 0}
        out = []
        for p, a, x, e in zip(prompts, starts, ids, embeds):
            audio_rows = (x == self.audio_id).nonzero().squeeze(1)
            visual_rows = torch.cat([(x == self.image_id).nonzero().squeeze(1), (x == self.video_id).nonzero().squeeze(1)])
            stack = None
            for rows, kind, tokens in ((audio_rows, "audio", audio), (visual_rows, "vision", vision)):
                if rows.numel():  # the prompt's tokens of this encoder: its items after the cut, in order
                    part = slice(taken[kind], taken[kind] + rows.numel())
                    taken[kind] = part.stop
                    e.index_copy_(0, to_device(rows, e.device), tokens[part].to(e.dtype))
                    if kind == "vision":
                        stack = (visual_rows, deepstack[:, part])
            positions, delta = self.rope_index(p)
            media = torch.isin(x, self.mm_ids).nonzero().squeeze(1)
            out.append(InputRows(e, positions[:, a:], delta, stack, media))
        return out

    # ---- internals ----------------------------------------------------------------------------------------
    def _clip_tokens(self, p) -> list[int]:
        if p.input_features is None:
            return []
        return [encoded_length(int(m.sum()), self.n_window) for m in p.feature_attention_mask.cpu()]

    def _vision_tokens(self, grid: torch.Tensor | None) -> list[int]:
        return [] if grid is None else (grid.cpu().prod(-1) // self.merge**2).tolist()

    def _items_after(self, p, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt p's media items whose rows lie at or after `start` (an item never straddles it): its clips'
        features [mel, frames], then its images' and its videos' patches and grids [1, 3], each kind in
        prompt order. The items before are those whose tokens the rows before `start` hold."""
        ids = p.input_ids.cpu()[:start]
        skip = lambda counts, token: _items_within(counts, int((ids == token).sum()))  # noqa: E731
        clips = [] if p.input_features is None else [
            f[:, : int(m.sum())] for f, m in zip(p.input_features, p.feature_attention_mask)]  # fmt: skip
        clips = clips[skip(self._clip_tokens(p), self.audio_id) :]
        patches, grids = [], []
        for pixels, grid, token in ((p.pixel_values, p.image_grid_thw, self.image_id),
                                    (p.pixel_values_videos, p.video_grid_thw, self.video_id)):  # fmt: skip
            if pixels is None:
                continue
            grid = grid.cpu()
            first = skip(self._vision_tokens(grid), token)
            patches += list(pixels.split(grid.prod(-1).tolist()))[first:]
            grids += list(grid.split(1))[first:]
        return clips, patches, grids


def _items_within(counts: list[int], tokens: int) -> int:
    """How many items (of these token counts, in order) the first `tokens` tokens hold whole."""
    total = 0
    for i, n in enumerate(counts):
        total += n
        if total > tokens:
            return i
    return len(counts)


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()
