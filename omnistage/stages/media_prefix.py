# Prefix reuse for thinker prompts with media (images, audio, video). The cache's block names carry a digest
# of each media item's decoded content (its patches or features, grid and timing), folded in at the block where
# the item starts, so placeholder ids that only say how long an item is can never make two different items
# share K/V. A kept prefix is cut back to the block where the first media item it does not hold whole starts,
# so no item is split between the cache and the forward; when the prompt feeds a talker, an item it holds
# counts only with its rows' accept-layer hidden states kept beside its blocks (they stand in for the ones
# the skipped forward would have given). What is left to run:
#   - text only (the kept prefix holds every item): the thinker's ChunkPrefill, batched;
#   - media items and text: the thinker's MediaPrefill after the prefix, batched (a conversation whose new
#     turn brings a new clip runs that turn alone);
#   - prompts the batched paths do not take (video, prompts longer than their buffers) run here, with a prefix
#     cut back to the blocks before their first media row unless it holds every item.
# Blocks are kept from their first prompt on, so a second request with the same media (or the next turn of a
# conversation that resends it) encodes nothing.
# The prefill here is one forward of transformers' thinker (its multimodal merge, deepstack, MRoPE positions).
from __future__ import annotations

import hashlib

import torch
from transformers import DynamicCache

from ..core.engine import StepResult
from ..core.prefix_index import BLOCK, PrefixIndex, PrefixMatch
from ..core.scheduler import Sequence
from .host_copy import to_device


class MediaPrefixPrefill:
    def __init__(self, runner):
        self.runner = runner  # ThinkerRunner: model, cache, prefix cache, sampling and output helpers
        t = runner.config.thinker_config
        self.ids = {name: getattr(t, f"{name}_token_id") for name in ("audio", "image", "video", "vision_start",
                                                                          "audio_start")}  # fmt: skip
        self.mm_ids = torch.tensor([self.ids["audio"], self.ids["image"], self.ids["video"]])
        # slot -> accept-layer rows by block of its prompt's media (store), for keep_turn
        self.turn_rows: dict[int, dict[int, torch.Tensor] | None] = {}

    def match(self, p, batched: bool) -> PrefixMatch | None:
        """The kept prefix of prompt p that its prefill can take (see the header): batched, the batched paths'
        (cut between items), else this one's; None without a cache."""
        if self.runner.prefix is None:
            return None
        ids = p.input_ids.cpu()
        salts = p.salts if p.salts is not None else self.salts(p, ids)
        return self._usable(self.runner.prefix.match(ids.tolist(), salts), ids, p.export_talker, batched)

    def still_kept(self, p, found: PrefixMatch) -> PrefixMatch:
        """`found` cut to the blocks still kept (a prompt stored earlier in the step may have evicted some since
        the match), then back between items again: what prefix.load will take."""
        run = PrefixMatch(found.names, found.entries[: self.runner.prefix.index.kept_run(found)])
        return self._usable(run, p.input_ids.cpu(), p.export_talker, True)

    def covers_media(self, p, found: PrefixMatch | None) -> bool:
        """Whether the kept prefix `found` (match()) holds every media row of p: only text is left to run."""
        mm = self._media_rows(p.input_ids.cpu())
        return found is not None and mm.numel() > 0 and found.tokens > int(mm[-1])

    def store(self, seq: Sequence, found: PrefixMatch, hidden: torch.Tensor | None) -> None:
        """Keeps the prompt's blocks (in its slot after a prefill) from this first sighting on, with its media
        rows' accept-layer hidden states when given (`hidden`: [L, D], every row of the prompt). The rows of
        its last full block wait for keep_turn (that block is kept with the reply)."""
        ids = seq.payload.input_ids.cpu()
        mm = self._media_rows(ids)
        mm = mm[mm < ids.numel() // BLOCK * BLOCK]  # rows of the blocks that can be kept
        rows = self._rows_by_block(mm, hidden) if hidden is not None else None
        self.runner.prefix.store(seq.slot, found, rows, first_sighting=True)
        self.turn_rows[seq.slot] = rows

    def keep_turn(self, seq: Sequence, length: int) -> None:
        """When a sequence ends: keeps the blocks of its prompt and reply (the first `length` of them, what
        its slot holds), so the conversation's next turn, which resends both, prefills only what is new."""
        p = seq.payload
        ids = self.runner._prompt_ids(seq)[:length]  # its prompt and reply: it has generated at least a token
        salts = p.salts if p.salts is not None else self.salts(p, ids)
        found = PrefixMatch(PrefixIndex.names(ids.tolist(), salts), [])
        self.runner.prefix.store(seq.slot, found, self.turn_rows.pop(seq.slot, None), first_sighting=True)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, found: PrefixMatch | None) -> StepResult:
        """One prompt with media, after the kept prefix `found` (match()) when there is one."""
        from .thinker import ThinkerOutput, _SlotState  # thinker.py imports this module

        r, p = self.runner, seq.payload
        ids = p.input_ids.cpu()
        mm = self._media_rows(ids)
        first = int(mm[0]) if mm.numel() else ids.numel()
        if found is not None:
            found = self._usable(found, ids, p.export_talker, False)
            r.prefix.load(seq.slot, found)
        start = found.tokens if found is not None else 0
        media = start <= first  # the rest holds every media row: its media go in with it
        positions, deltas = self._positions(p, ids)
        past = DynamicCache(config=r.text_config)
        if start:
            for layer, (k, v) in enumerate(zip(*r.cache.read(seq.slot, start))):
                past.update(k, v, layer)
        dev = r.device
        out = r.model(
            input_ids=to_device(ids[start:], dev)[None],
            position_ids=positions[:, :, start:],
            pixel_values=_to(p.pixel_values, dev, r.dtype) if media else None,
            image_grid_thw=_to(p.image_grid_thw, dev) if media else None,
            input_features=_to(p.input_features, dev, r.dtype) if media else None,
            feature_attention_mask=_to(p.feature_attention_mask, dev) if media else None,
            pixel_values_videos=_to(p.pixel_values_videos, dev, r.dtype) if media else None,
            video_grid_thw=_to(p.video_grid_thw, dev) if media else None,
            video_second_per_grid=_to(p.video_second_per_grid, dev) if media else None,
            use_audio_in_video=p.use_audio_in_video,
            past_key_values=past,
            use_cache=True,
            output_hidden_states=p.export_talker,
        )
        length = r.cache.load_prefill(seq.slot, past, start=start)
        r.slots[seq.slot] = _SlotState(length, int(deltas.reshape(-1)[0]), 0)
        token = r._sample(out.logits[:, -1], [seq])
        talker = tail = hidden = None
        if p.export_talker and not p.resumed_from:
            head = r.model.get_input_embeddings()(to_device(ids[:start], dev))  # [start, D] layer-0 rows
            embeds = torch.cat([head, out.hidden_states[0][0]])
            hidden = torch.cat([self.kept_rows(p, head, found), out.hidden_states[r.accept_layer][0]])
            talker, tail = r._talker_conditioning(ids, embeds, hidden)
        if found is not None:
            self.store(seq, found, hidden)
        output = ThinkerOutput(talker=talker, prompt_tokens=None if p.resumed_from else length, text_rows=tail,
                               cached_tokens=None if p.resumed_from else start)
        return r._accept(seq, int(token[0]), output, r._text_rows(token, [seq]))

    def _media_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(ids, self.mm_ids).nonzero().squeeze(1)  # host: media row positions

    # ---- keys ---------------------------------------------------------------------------------------------
    def salts(self, p, ids: torch.Tensor) -> dict[int, bytes]:
        """Block number -> digest of the media items whose rows start in it, items in prompt order (the
        processor's: images, videos and clips each consumed in the order their markers appear)."""
        items = self._item_digests(p)
        salts: dict[int, bytes] = {}
        vs, as_ = self.ids["vision_start"], self.ids["audio_start"]
        marks = ((ids == vs) | (ids == as_)).nonzero().squeeze(1).tolist()
        ids = ids.tolist()
        for pos in marks:
            if ids[pos] == as_ and pos > 0 and ids[pos - 1] == vs:
                continue  # the audio half of a video with its track: digested with the video
            nxt = ids[pos + 1] if pos + 1 < len(ids) else -1
            kind = "audio" if ids[pos] == as_ else "image" if nxt == self.ids["image"] else "video"
            if not items[kind]:
                continue
            digest = items[kind].pop(0)
            if kind == "video" and p.use_audio_in_video and items["audio"]:
                digest += items["audio"].pop(0)
            block = pos // BLOCK
            salts[block] = salts.get(block, b"") + digest
        return salts

    def _item_digests(self, p) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {"image": [], "video": [], "audio": []}
        for kind, rows, grids in (("image", p.pixel_values, p.image_grid_thw),
                                  ("video", p.pixel_values_videos, p.video_grid_thw)):  # fmt: skip
            if rows is None:
                continue
            extra = p.video_second_per_grid if kind == "video" else None
            for i, part in enumerate(rows.split(grids.prod(-1).tolist())):
                timing = extra[i : i + 1] if extra is not None else None
                out[kind].append(_digest(grids[i], part, timing))
        if p.input_features is not None:
            for features, mask in zip(p.input_features, p.feature_attention_mask):
                n = int(mask.sum())
                out["audio"].append(_digest(torch.tensor([n]), features[:, :n]))
        return out

    # ---- reuse --------------------------------------------------------------------------------------------
    def _usable(self, found: PrefixMatch, ids: torch.Tensor, export: bool, batched: bool) -> PrefixMatch:
        """The kept prefix cut to what a prefill can take (see the header): batched, back to the block where
        the first item it does not hold (with its talker rows when export) starts, and further while that
        block boundary splits an earlier item; else, unless it holds every item, to before the first item."""
        items = self._items(ids)
        kept = self.runner.prefix.media_rows
        held = lambda a, b: b < found.tokens and (  # noqa: E731
            not export or all(found.entries[k] in kept for k in range(a // BLOCK, b // BLOCK + 1)))
        whole = 0
        while whole < len(items) and held(*items[whole]):
            whole += 1
        if whole == len(items):
            return found
        cut = items[0][0] // BLOCK if not batched else items[whole][0] // BLOCK
        for a, b in reversed(items[:whole]):  # an item across the cut goes after it whole
            if a < cut * BLOCK <= b:
                cut = a // BLOCK
        return PrefixMatch(found.names, found.entries[: min(cut, len(found.entries))])

    def _items(self, ids: torch.Tensor) -> list[tuple[int, int]]:
        """The first and last row of each run of consecutive media rows (an item), in order."""
        mm = self._media_rows(ids)
        if not mm.numel():
            return []
        breaks = (mm[1:] != mm[:-1] + 1).nonzero().squeeze(1)
        firsts = torch.cat([mm[:1], mm[breaks + 1]]).tolist()
        lasts = torch.cat([mm[breaks], mm[-1:]]).tolist()
        return list(zip(firsts, lasts))

    def kept_rows(self, p, head: torch.Tensor, found: PrefixMatch | None) -> torch.Tensor:
        """Accept-layer rows of p's first head.shape[0] rows for the talker: the kept media rows of the prefix
        `found` at their places, the layer-0 rows `head` elsewhere (text rows take those)."""
        mm = self._media_rows(p.input_ids.cpu())
        kept = mm[mm < min(head.shape[0], found.tokens if found is not None else 0)]
        if not kept.numel():
            return head
        rows = torch.cat([self.runner.prefix.media_rows[found.entries[b]] for b in (kept // BLOCK).unique().tolist()])
        head = head.clone()
        head[to_device(kept, head.device)] = rows.to(head.dtype)
        return head

    @staticmethod
    def _rows_by_block(mm: torch.Tensor, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """Block number -> the rows `mm` (host, ascending) of `hidden` in that block: one gather for all."""
        if not mm.numel():
            return {}
        blocks, counts = torch.unique_consecutive(mm // BLOCK, return_counts=True)
        rows = hidden.index_select(0, to_device(mm, hidden.device))
        return dict(zip(blocks.tolist(), rows.split(counts.tolist())))

    def _positions(self, p, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MRoPE positions [3, 1, L] and the rope delta of the whole prompt (transformers' get_rope_index)."""
        r = self.runner
        ids = to_device(ids, r.device)[None]
        lengths = p.feature_attention_mask.sum(-1) if p.feature_attention_mask is not None else None
        return r.model.get_rope_index(
            ids, _to(p.image_grid_thw, r.device), _to(p.video_grid_thw, r.device), torch.ones_like(ids),
            p.use_audio_in_video, _to(lengths, r.device), _to(p.video_second_per_grid, r.device),
        )  # fmt: skip


def _digest(*tensors) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is not None:
            t = t.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def _to(t: torch.Tensor | None, device, dtype=None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(device=device, dtype=dtype) if dtype is not None and t.is_floating_point() else t.to(device)
