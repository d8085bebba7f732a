# Prefix reuse for thinker prompts with media (images, audio, video). The cache's block names carry a digest
# of each media item's decoded content (its patches or features, grid and timing), folded in at the block where
# the item starts, so placeholder ids that only say how long an item is can never make two different items
# share K/V. A kept prefix is cut back to the block where the first media item it does not hold whole starts,
# so no item is split between the cache and the forward (a video taken with its audio track is one item:
# its frames' and its clip's rows interleave); when the prompt feeds a talker, an item it holds counts only
# with its rows' accept-layer hidden states kept beside its blocks (they stand in for the ones the skipped
# forward would have given). What is left to run (stages/thinker_prefill.py):
#   - text only (the kept prefix holds every item): the thinker's ChunkPrefill, batched;
#   - media items and text: the thinker's MediaPrefill after the prefix, or LongPrefill's pieces after it
#     for a prompt longer than the media buffers, batched either way.
# Blocks are kept from their first prompt on, so a second request with the same media (or the next turn of a
# conversation that resends it) encodes nothing.
from __future__ import annotations

import hashlib

import torch

from ..core.prefix_index import BLOCK, PrefixIndex, PrefixMatch
from ..core.scheduler import Sequence
from .host_copy import to_device


class MediaPrefixCache:
    def __init__(self, runner):
        self.runner = runner  # ThinkerRunner: model, cache, prefix cache, sampling and output helpers
        t = runner.config.thinker_config
        self.ids = {name: getattr(t, f"{name}_token_id") for name in ("audio", "image", "video", "vision_start",
                                                                          "audio_start")}  # fmt: skip
        self.mm_ids = torch.tensor([self.ids["audio"], self.ids["image"], self.ids["video"]])
        # slot -> accept-layer rows by block of its prompt's media (store), for keep_turn
        self.turn_rows: dict[int, dict[int, torch.Tensor] | None] = {}

    def match(self, p, peek: bool = False) -> PrefixMatch | None:
        """The kept prefix of prompt p that its prefill can take (cut between items, see the header); None
        without a cache. peek: counting nothing (a lookup at admission)."""
        if self.runner.prefix is None:
            return None
        ids = p.input_ids.cpu()
        salts = p.salts if p.salts is not None else self.salts(p, ids)
        look = self.runner.prefix.index.peek if peek else self.runner.prefix.match
        return self.usable(look(ids.tolist(), salts), p)

    def still_kept(self, p, found: PrefixMatch) -> PrefixMatch:
        """`found` cut to the blocks still kept (a prompt stored earlier in the step may have evicted some since
        the match), then back between items again: what prefix.load will take."""
        run = PrefixMatch(found.names, found.entries[: self.runner.prefix.index.kept_run(found)])
        return self.usable(run, p)

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
    def usable(self, found: PrefixMatch, p) -> PrefixMatch:
        """The kept prefix `found` of prompt p cut to what a prefill can take (see the header): back to the
        block where the first item it does not hold (with its talker rows when p feeds a talker) starts, and
        further while that block boundary splits an earlier item."""
        ids, export = p.input_ids.cpu(), p.export_talker
        items = self._items(ids)
        kept = self.runner.prefix.media_rows
        held = lambda a, b: b < found.tokens and (  # noqa: E731
            not export or all(found.entries[k] in kept for k in range(a // BLOCK, b // BLOCK + 1)))
        whole = 0
        while whole < len(items) and held(*items[whole]):
            whole += 1
        if whole == len(items):
            return found
        cut = items[whole][0] // BLOCK
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


def _digest(*tensors) -> bytes:
    # hashed in place: copying a video's patches (a 10 s clip: 34 MB of float32) would add half again to the
    # time the thinker's request thread spends on such a prompt; SHA-256 runs on the CPUs' own instructions
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            t = t.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.digest()[:16]
