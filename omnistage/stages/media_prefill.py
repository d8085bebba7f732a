# The thinker's prefill of a step's prompts with audio or image rows (and the text-only prompts of the same
# step) in one forward from static buffers, replayed as a CUDA graph per (rows, tokens) bucket as
# StaticPrefill does for text-only steps. A prompt may start after a kept prefix already in its slot (a
# system prompt, a conversation's earlier turns: stages/media_prefix.py cuts it between media items): then
# its row holds the prompt from `start` on, and the step attends over the slots' positions as ChunkPrefill
# does, one graph per (rows, tokens, kv) bucket. What transformers' thinker forward does for one prompt, done
# for all of them at once:
# - every clip and image of the rows (those after each row's start) through the audio encoder in one call
#   and the vision encoder in one call (audio_encoder.py, vision_encoder.py), their tokens scattered into
#   the input embeddings at the rows' audio / image placeholder positions;
# - MRoPE positions per row from transformers' get_rope_index of the whole prompt (host side, from the
#   token ids and the media geometry) from the row's start on, each row's rope delta kept for its decode steps;
# - the vision encoder's deepstack features added to the residual stream at image positions after the
#   first len(deepstack) layers (zero elsewhere, so the add is dense and the same work every replay);
# - the residual stream entering layer accept_layer kept for the talker's conditioning on media rows.
# Rows are right-padded to the bucket's tokens and padding rows repeat row 0 (see static_prefill.py).
from __future__ import annotations

import torch

from ..core.errors import BadRequestError
from ..models.layer_stack import run_layers
from .audio_encoder import AudioEncoder, encoded_length
from .chunk_prefill import attend_after_prefix
from .cuda_graphs import bucket_for, length_buckets
from .host_copy import to_device
from .paged_kv import PagedKVCache, PagedWriter
from .positioned_prefill import PositionedPrefill


class MediaPrefill(PositionedPrefill):
    """StaticPrefill's buffers, buckets and graphs with per-row MRoPE positions (PositionedPrefill), plus
    deepstack rows, the accept layer's rows and the media encoders."""

    def __init__(self, name: str, thinker, cache: PagedKVCache, *, max_rows: int, max_tokens: int,
                 accept_layer: int, cuda_graphs: bool):  # fmt: skip
        from .vision_encoder import VisionEncoder  # transformers' vision helpers: imported with the runner

        super().__init__(f"{name}_media", thinker.model, cache, max_rows=max_rows, max_tokens=max_tokens,
                         cuda_graphs=cuda_graphs)  # fmt: skip
        self.thinker = thinker
        self.audio, self.vision = AudioEncoder(thinker.audio_tower), VisionEncoder(thinker.visual)
        c = thinker.config
        self.audio_id, self.image_id = c.audio_token_id, c.image_token_id
        deepstack = len(c.vision_config.deepstack_visual_indexes)
        if accept_layer <= deepstack:
            raise ValueError(f"accept layer {accept_layer} lies among the deepstack layers (first {deepstack})")
        layers = len(self.text_model.layers)
        # layer ranges between the points where the stream is touched: each deepstack add, the accept layer
        cuts = sorted({*range(1, deepstack + 1), accept_layer, layers})
        self.spans = list(zip([0] + cuts[:-1], cuts))
        self.deepstack_count, self.accept_layer = deepstack, accept_layer
        rows, tokens, hidden = self.embeds.shape
        device, dtype = self.embeds.device, self.embeds.dtype
        self.deepstack = torch.zeros(deepstack, rows, tokens, hidden, dtype=dtype, device=device)
        self.accept_out = torch.zeros(rows, tokens, hidden, dtype=dtype, device=device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)  # where each row begins in its slot
        # attended lengths of steps with a kept prefix: a prompt's prefix and suffix together fit the buffers
        self.kv_buckets = length_buckets(self.max_tokens) if self.bank.enabled else None

    def validate(self, p) -> None:
        """A prompt whose placeholder counts differ from its media's token counts is the client's error (the
        processor never makes one); found at admission, so it fails no other prompt of a step."""
        ids = p.input_ids.cpu()
        audio = 0
        if p.input_features is not None:
            n_window = self.audio.tower.config.n_window
            audio = sum(encoded_length(int(m.sum()), n_window) for m in p.feature_attention_mask.cpu())
        image = 0
        if p.image_grid_thw is not None:
            image = int((p.image_grid_thw.cpu().prod(-1) // self.vision.merge**2).sum())
        for what, want, placeholder in (("audio", audio, self.audio_id), ("image", image, self.image_id)):
            have = int((ids == placeholder).sum())
            if have != want:
                raise BadRequestError(f"prompt has {have} {what} placeholder tokens for {want} {what} tokens")

    def fits(self, starts: list[int], lengths: list[int]) -> bool:
        """Whether rows of these starts and lengths (prompt tokens after the start) can run as one step."""
        rows, tokens, kv_len = self.step_shape(starts, lengths)
        return rows <= self.max_rows and tokens <= self.max_tokens and (kv_len or 0) <= self.max_tokens

    def step_shape(self, starts: list[int], lengths: list[int]) -> tuple[int, int, int | None]:
        """(rows, tokens, kv_len) a step runs at; kv_len None: every row starts at 0 (attention over the new
        tokens alone), else every padded position lies below it."""
        rows, tokens = self.shape_for(len(lengths), max(lengths))
        if not any(starts):
            return rows, tokens, None
        kv_len = max(starts) + tokens
        if self.kv_buckets and kv_len <= self.max_tokens:
            kv_len = bucket_for(kv_len, self.kv_buckets)
        return rows, tokens, kv_len

    def run(self, prompts: list, slots: list[int], starts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """prompts: ThinkerPrompts (input_ids and media on the host); slots: where each one's K/V goes; starts:
        where each prompt's new rows begin (its slot holds the positions before, see fits()), default 0.
        Returns the normed hidden state at each prompt's last position [n, D] and each prompt's rope delta.
        After it, embeds_out(i) and accept_out[i] hold prompt i's rows from its start on: input embeddings and
        accept-layer rows (static buffers: read before the next run)."""
        n = len(prompts)
        starts = starts or [0] * n
        lengths = [int(p.input_ids.numel()) - a for p, a in zip(prompts, starts)]
        for slot, start, length in zip(slots, starts, lengths):
            self.cache.grow(slot, start + length)
        self.cache.sync()
        rows, tokens, kv_len = self.step_shape(starts, lengths)
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        for i, (p, start) in enumerate(zip(prompts, starts)):
            ids[i, : lengths[i]] = p.input_ids[start:]
        ids[n:] = ids[:1]
        positions, deltas = zip(*(self.rope_index(p) for p in prompts))
        embeds = self.embeds[:rows, :tokens]
        embeds.copy_(self.thinker.get_input_embeddings()(to_device(ids, embeds.device)))
        self._scatter_media([self._items_after(p, a) for p, a in zip(prompts, starts)], ids[:n])
        self.load_positions([x[:, a:] for x, a in zip(positions, starts)], rows, tokens)
        if rows > n:
            embeds[n:].copy_(embeds[:1].expand(rows - n, -1, -1))
            self.deepstack[:, n:rows, :tokens].copy_(self.deepstack[:, :1, :tokens].expand(-1, rows - n, -1, -1))
        pad = rows - n
        index = to_device([slots + slots[:1] * pad, [x - 1 for x in lengths + lengths[:1] * pad],
                           starts + starts[:1] * pad], self.slots.device)  # fmt: skip
        self.slots[:rows].copy_(index[0])
        self.last[:rows].copy_(index[1])
        self.starts[:rows].copy_(index[2])
        key = (rows, tokens) if kv_len is None else (rows, tokens, kv_len)
        self.bank.run(key, lambda: self._run(*key))
        return self.hidden_out[:n], list(deltas)

    def capture_all(self) -> None:
        """StaticPrefill's (rows, tokens) buckets, and (rows, tokens, kv) ones for steps after kept prefixes."""
        if not self.bank.enabled:
            return
        self.starts.zero_()
        super().capture_all()
        keys = [(r, t, k) for r in self.row_buckets for t in self.token_buckets for k in self.kv_buckets if t <= k]
        self.bank.capture_all(keys, lambda key: lambda: self._run(*key))

    def embeds_out(self, row: int, length: int) -> torch.Tensor:
        return self.embeds[row, :length]

    # ---- internals ----------------------------------------------------------------------------------------
    def rope_index(self, p) -> tuple[torch.Tensor, int]:
        """MRoPE positions [3, L] and rope delta of one prompt, as transformers' forward computes them (for a
        text-only prompt 0..L-1 on every section, delta 0, without its per-token host loop); the prompt's
        own when its admission derived them."""
        if p.is_text_only:
            return torch.arange(p.input_ids.numel()).expand(3, -1), 0
        if p.rope is not None:
            return p.rope
        ids = p.input_ids[None].cpu()
        lengths = p.feature_attention_mask.cpu().sum(-1) if p.feature_attention_mask is not None else None
        grid = p.image_grid_thw.cpu() if p.image_grid_thw is not None else None
        pos, delta = self.thinker.get_rope_index(ids, grid, None, torch.ones_like(ids), False, lengths, None)
        return pos[:, 0], int(delta.reshape(-1)[0])

    def _items_after(self, p, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt p's media items whose rows lie at or after `start` (an item never straddles it): its clips'
        features [mel, frames], its images' patches and grids [1, 3]. Items are in prompt order per kind."""
        ids = p.input_ids.cpu()
        before = {}
        for kind, token in (("audio", self.audio_id), ("image", self.image_id)):
            rows = ids == token
            first = rows & ~torch.cat([torch.tensor([False]), rows[:-1]])  # the first row of each item
            before[kind] = int(first[:start].sum())
        clips = [] if p.input_features is None else [
            f[:, : int(m.sum())] for f, m in zip(p.input_features, p.feature_attention_mask)][before["audio"]:]
        patches, grids = [], []
        if p.pixel_values is not None:
            grid = p.image_grid_thw.cpu()
            patches = list(p.pixel_values.split(grid.prod(-1).tolist()))[before["image"]:]
            grids = list(grid.split(1))[before["image"]:]
        return clips, patches, grids

    def _scatter_media(self, items: list, ids: torch.Tensor) -> None:
        """Encodes every clip and image of `items` (per row: _items_after) in one call per encoder and writes
        their tokens into self.embeds, the deepstack features into self.deepstack, at the placeholder
        positions of rows 0..n-1 (ids [n, tokens] on the host; the deepstack rows elsewhere are zero)."""
        n, tokens = ids.shape
        width = self.embeds.shape[1]
        flat_rows = (torch.arange(n)[:, None] * width + torch.arange(tokens)[None]).reshape(-1)
        flat_ids = ids.reshape(-1)
        self.deepstack[:, :n, :tokens].zero_()
        clips = [c for row in items for c in row[0]]
        if clips:
            audio, _ = self.audio(clips)
            where = to_device(flat_rows[flat_ids == self.audio_id], audio.device)
            self.embeds.view(-1, self.embeds.shape[-1]).index_copy_(0, where, audio.to(self.embeds.dtype))
        patches = [x for row in items for x in row[1]]
        if patches:
            pixels = torch.cat(patches)
            image, deepstack, _ = self.vision(pixels, torch.cat([g for row in items for g in row[2]]))
            where = to_device(flat_rows[flat_ids == self.image_id], image.device)
            self.embeds.view(-1, self.embeds.shape[-1]).index_copy_(0, where, image.to(self.embeds.dtype))
            for layer, features in enumerate(deepstack):
                self.deepstack[layer].view(-1, features.shape[-1]).index_copy_(0, where, features.to(self.embeds.dtype))

    def _run(self, rows: int, tokens: int, kv_len: int | None = None) -> None:
        hidden = self.embeds[:rows, :tokens]
        position_embeddings = self.text_model.rotary_emb(hidden, self.positions[:, :rows, :tokens])
        if kv_len is None:  # every row from position 0: sdpa runs causal over the new tokens, no mask
            steps = torch.arange(tokens, device=hidden.device)[None].expand(rows, tokens)
            mask, writer = None, PagedWriter(self.cache, self.slots[:rows], steps, None)
        else:
            mask, writer = attend_after_prefix(self.cache, self.slots[:rows], self.starts[:rows], tokens, kv_len)
        layers = self.text_model.layers
        for start, end in self.spans:
            if start == self.accept_layer:
                self.accept_out[:rows, :tokens].copy_(hidden)
            last = end == len(layers)
            hidden = run_layers(layers[start:end], hidden, self.text_model.norm if last else None, attention_mask=mask,
                                position_embeddings=position_embeddings, past_key_values=writer)  # fmt: skip
            if end <= self.deepstack_count:
                hidden = hidden + self.deepstack[end - 1, :rows, :tokens]
        last = hidden[torch.arange(rows, device=hidden.device), self.last[:rows]]  # [rows, D], normed
        self.hidden_out[:rows].copy_(last)
