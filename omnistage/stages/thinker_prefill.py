# The thinker's prefill step: which of a step's prompts goes which way, all of them batched and, but for
# long prompts' pieces (see LongPrefill), graph-replayed on CUDA:
#   - prompts whose kept prefix leaves only text to run (text-only prompts after a shared prefix, media
#     prompts whose kept prefix holds all their media): that text, ChunkPrefill;
#   - prompts with media rows (audio, images, video, a video's audio track) that fit the static buffers,
#     each after its kept prefix, joined by the step's other fresh prompts while rows remain: MediaPrefill;
#   - other text-only prompts that fit the static buffers: StaticPrefill;
#   - longer prompts, text or media, and whatever the above could not take this step: this step's piece of
#     each, in rows of CHUNK_TOKENS, LongPrefill.
# The media of a step, the MediaPrefill's prompts and the first pieces of long media prompts, go through
# each encoder once (MediaInputs.rows); a long media prompt's rows are kept from its first piece to its last.
# A piece that does not end its prompt answers with a StepResult without output. Blocks worth keeping are
# kept once their prompt is in its slot (long text prompts' on probation: core/prefix_index.py; media
# prompts' with their media rows' accept-layer states: media_prefix_cache.py).
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..core.block_pool import BLOCK
from ..core.engine import StepResult
from ..core.prefix_index import PrefixMatch
from ..core.scheduler import Sequence
from .host_copy import outputs_to_host, to_device
from .media_rows import InputRows


# A step's prompts that take a kept prefix go through its decode forward when at most JOINT_ROWS[-1] of them
# come (riders()); on CUDA graphs are captured for those row buckets of each chunk-prefill token bucket
# beside every decode step's rows bucket.
JOINT_ROWS = (1, 2, 4)


@dataclass
class LongMedia:
    """A media prompt in pieces, from its first piece to its last."""

    rows: InputRows  # its rows from `start` on: embeddings with its media in place, positions, deepstack rows
    start: int  # where its pieces start: the end of the kept prefix its slot took
    found: PrefixMatch | None  # its prefix match (the blocks to keep once it is in its slot)
    accepted: list[torch.Tensor] = field(default_factory=list)  # accept-layer rows at its media rows, by piece


class ThinkerPrefill:
    """ThinkerRunner's prefill (a mixin: it reads the runner's prefills, caches and sampling helpers)."""

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[StepResult]:
        """Every prompt of a step, or this step's piece of it (see the header)."""
        taken = self._start(seqs)
        whole = [s for s in seqs if not self._in_chunks(s)]
        text = [s for s in whole if s.payload.is_text_only]
        media = [s for s in whole if not s.payload.is_text_only]
        # prompts the chunk prefill could serve look up their prefixes here; longer ones took theirs at
        # admission (prefix_blocks)
        found = {id(s): self.prefix.match(s.payload.input_ids.tolist()) for s in text
                 if s.payload.input_ids.numel() <= self.chunk_prefill.max_kv} if self.prefix else {}  # fmt: skip
        kept = {id(s): self.media_prefix.match(s.payload) for s in media} if self.prefix else {}
        covered = {id(s): kept[id(s)] for s in media if self.media_prefix.covers_media(s.payload, kept.get(id(s)))}
        hits = self._chunk_hits([s for s in whole if id(s) in found or id(s) in covered], found | covered)
        served = {id(s) for s in hits}
        fresh = [s for s in text if id(s) not in served][: self.static_prefill.max_rows]
        rows = self.media_prefill.max_rows
        media = [s for s in media if id(s) not in served][:rows]
        joined = media + fresh[: rows - len(media)] if media else []
        ran, starts = self._fit_media(joined, kept)
        in_joined = {id(s) for s in joined}
        fresh = [s for s in fresh if id(s) not in in_joined]
        served |= {id(s) for s in ran + fresh}
        long = [s for s in seqs if id(s) not in served]  # in pieces, or whole where no batched path took it
        # one call per encoder for the step's media: the batched prompts' and long media prompts' first pieces
        first = [s for s in long if not s.payload.is_text_only and s.slot not in self.long_media]
        first_starts = [s.piece(self.prompt_tokens(s))[0] for s in first]
        encoded = self.media.rows([s.payload for s in ran + first], starts + first_starts) if ran or first else []
        for s, a, r in zip(first, first_starts, encoded[len(ran) :]):  # the blocks to keep once it is in
            match = taken[id(s)] if id(s) in taken else kept[id(s)] if id(s) in kept else (
                self.media_prefix.match(s.payload) if self.prefix else None)  # fmt: skip
            self.long_media[s.slot] = LongMedia(r, a, match)
        results = self._prefill_after_prefix(hits, found | covered) if hits else []
        results += self._prefill_static(fresh) if fresh else []
        results += self._prefill_media(ran, starts, encoded[: len(ran)], kept) if ran else []
        for seq in text:  # keep the blocks worth keeping (copied in stream order: after the prefill)
            if id(seq) in found:
                self.prefix.store(seq.slot, found[id(seq)])
        if long:
            pieces, spans = self._long_pieces(long)
            last, accepted = self.long_prefill.run(pieces)
            results += self._long_results(long, spans, last, accepted)
        # the talker's conditioning was gathered after the tokens' sync: one more sync (none on the CPU)
        outputs_to_host([r.output for r in results if r.output is not None], self.device)
        return results

    def riders(self, seqs: list[Sequence]) -> list[Sequence]:
        """The prompts of a step whose prefill goes through the step's decode forward (decode()'s riders),
        where one forward then reads the experts' weights for both (layer_stack.run_joint). A step beside
        many streams takes a new prompt or two, and a forward of its own read the experts a second time
        (~10 ms of the H200 a step). In turn, the first kind the step has:
          - long prompts' pieces whose rows need no encoder this step (a text prompt's, or a media prompt's
            after its first piece);
          - text prompts whose kept prefix leaves a suffix for the chunk prefill (W1's ~38 tokens after its
            shared system prompt), all of them if at most JOINT_ROWS[-1];
          - up to JOINT_ROWS[-1] media prompts whose media are not all kept: their rows (encoded together in
            decode()) as one row of the long prefill's each."""
        long = [s for s in seqs if self._in_chunks(s) and (s.payload.is_text_only or (
            s.slot in self.long_media and not s.first_piece))]  # fmt: skip
        if long:
            return long
        fresh = [s for s in seqs if not s.num_generated and not self._in_chunks(s)]
        text = [s for s in fresh if s.payload.is_text_only]
        found = self._suffix_hits(text) if self.prefix else {}
        hits = [s for s in text if id(s) in found]
        if hits:
            return hits if len(hits) <= JOINT_ROWS[-1] and self._suffixes_fit(hits, found) else []
        media = [s for s in fresh if not s.payload.is_text_only]
        if len(media) > JOINT_ROWS[-1] or self.prefix and any(self.media_prefix.covers_media(
                s.payload, self.media_prefix.match(s.payload, peek=True)) for s in media):  # fmt: skip
            return []  # more go in one MediaPrefill forward; one whose media are kept, in the chunk prefill
        return media

    def prefix_blocks(self, seq: Sequence) -> list[int]:
        """The kept prefix a waiting prompt in chunks starts with (core/scheduler.py): its pool blocks, cut
        between items where it has media. A conversation's next turn finds its earlier turns here: a long
        prompt's blocks are kept after its prefill (see prefill())."""
        if self.prefix is None or not self._in_chunks(seq):
            return []
        if seq.payload.is_text_only:
            return self.prefix.peek(self._prompt_ids(seq).tolist()).entries
        return self.media_prefix.match(seq.payload, peek=True).entries

    def preempt(self, seq: Sequence) -> None:
        super().preempt(seq)
        if 0 <= seq.slot < len(self.slots):
            self.long_media.pop(seq.slot, None)

    # ---- internals ----------------------------------------------------------------------------------------
    def _resume(self, seq: Sequence) -> None:
        """The sequence was preempted after generating seq.generated: its prompt becomes the original prompt and
        those tokens, whose prefill picks its next token as its next decode step would have."""
        original = seq.payload.resumed_from or int(seq.payload.input_ids.numel())
        # what admission derived from the original prompt does not hold for the longer one
        seq.payload = replace(seq.payload, input_ids=self._prompt_ids(seq), resumed_from=original, salts=None,
                              rope=None)  # fmt: skip

    def _take_prefix(self, seq: Sequence) -> PrefixMatch:
        """The slot of a prompt in chunks starts with the kept prefix it was admitted with (seq.prefix). Its
        blocks are kept still (nothing evicts between the schedule and this prefill); should fewer be, its
        first piece starts where they end (for a media prompt, cut between items)."""
        p = seq.payload
        if p.is_text_only:
            found = self.prefix.match(p.input_ids.tolist())
        else:
            found = self.media_prefix.still_kept(p, self.media_prefix.match(p))
        del found.entries[len(seq.prefix) :]
        self.prefix.load(seq.slot, found)
        if found.entries != seq.prefix:
            seq.chunk += seq.cached - found.tokens
            seq.prefix = found.entries
        return found

    def _chunk_hits(self, seqs: list[Sequence], found: dict) -> list[Sequence]:
        """The prompts with a kept prefix, in order, as many as fit one ChunkPrefill step together (the others
        prefill in full, which is correct, only slower)."""
        hits, suffix, start = [], 0, 0
        for s in seqs:
            kept = found.get(id(s))
            if kept is None or not kept.entries:
                continue
            longer, further = max(suffix, self.prompt_tokens(s) - kept.tokens), max(start, kept.tokens)
            if self.chunk_prefill.fits(len(hits) + 1, longer, further):
                hits.append(s)
                suffix, start = longer, further
        return hits

    def _suffix_hits(self, seqs: list[Sequence], take: bool = False) -> dict:
        """The kept prefixes of text prompts short enough for the chunk prefill, by id(seq), those that have
        one; take: as the prefill takes them (PrefixCache.match), else a look that counts nothing."""
        look = self.prefix.match if take else self.prefix.peek
        found = {id(s): look(s.payload.input_ids.tolist()) for s in seqs
                 if s.payload.input_ids.numel() <= self.chunk_prefill.max_kv}  # fmt: skip
        return {k: m for k, m in found.items() if m.entries}

    def _suffixes_fit(self, seqs: list[Sequence], found: dict, decode_shape: tuple[int, int] | None = None) -> bool:
        """Whether the prompts' suffixes after their kept prefixes go in one chunk prefill forward (beside a
        decode step of decode_shape, where given: ChunkPrefill.joins)."""
        suffix = max(self.prompt_tokens(s) - found[id(s)].tokens for s in seqs)
        start = max(found[id(s)].tokens for s in seqs)
        if decode_shape is None:
            return self.chunk_prefill.fits(len(seqs), suffix, start)
        return self.chunk_prefill.joins(decode_shape, len(seqs), suffix, start)

    def _prefill_static(self, seqs: list[Sequence]) -> list[StepResult]:
        """Text-only prompts through the static prefill (stages/static_prefill.py). The talker's conditioning
        of a text-only prompt needs only its input embeddings (no media rows take hidden states)."""
        embeds = [self._embed(s.payload.input_ids) for s in seqs]
        last = self.static_prefill.run(embeds, [s.slot for s in seqs])
        tokens = self._sample(self.model.lm_head(last), seqs)
        rows = self._text_rows(tokens, seqs)
        # no media rows, so the accept layer's hidden states are never read: the embeddings stand in
        return [self._prefilled_text(seq, e.shape[0], token, e, e, rows, i)
                for i, (seq, e, token) in enumerate(zip(seqs, embeds, tokens.tolist()))]  # fmt: skip

    def _prefill_after_prefix(self, seqs: list[Sequence], found: dict, beside: tuple | None = None
                              ) -> list[StepResult]:  # fmt: skip
        """Prompts whose kept prefix (`found`) leaves only text: that text through the chunk prefill
        (stages/chunk_prefill.py), at the prompt's rope delta (text after media sits at its index plus the
        delta on every MRoPE section). The talker's conditioning of a prompt with media takes its media rows'
        accept-layer hidden states kept with the prefix (the layer-0 embeddings on text rows). beside: (the
        decoder, its step()'s arguments), a decode step run in the same forward (ChunkPrefill.run_beside)."""
        embeds = [self._embed(s.payload.input_ids) for s in seqs]
        deltas = [self.media.rope_index(s.payload)[1] for s in seqs]
        for s in seqs:
            self.prefix.load(s.slot, found[id(s)])
        starts = [found[id(s)].tokens for s in seqs]  # as loaded
        args = ([e[p:] for e, p in zip(embeds, starts)], [s.slot for s in seqs], starts, deltas)
        last = self.chunk_prefill.run(*args) if beside is None else self.chunk_prefill.run_beside(*beside, *args)
        tokens = self._sample(self.model.lm_head(last), seqs)
        rows = self._text_rows(tokens, seqs)
        results = []
        for i, (seq, e, token, delta) in enumerate(zip(seqs, embeds, tokens.tolist(), deltas)):
            media = not seq.payload.is_text_only
            hidden = self.media_prefix.kept_rows(seq.payload, e, found[id(seq)]) if media else e
            if media:  # the text blocks after the media, kept as a media prompt's are (before keep_turn can run)
                self.media_prefix.store(seq, found[id(seq)], None)
            results.append(self._prefilled_text(seq, e.shape[0], token, e, hidden, rows, i, rope_delta=delta,
                                                cached=starts[i]))
        return results

    def _fit_media(self, seqs: list[Sequence], kept: dict) -> tuple[list[Sequence], list[int]]:
        """Which of the prompts run in one MediaPrefill step, and where each starts: after its kept prefix
        (`kept`: their prefix matches, loaded into their slots here), or at 0 where the prefix would stretch
        the step past the buffers; those that do not fit even so go in pieces."""
        starts, lengths, ran = [], [], []
        for seq in seqs:
            n, found = self.prompt_tokens(seq), kept.get(id(seq))
            if found is not None and found.entries:
                found = kept[id(seq)] = self.media_prefix.still_kept(seq.payload, found)
            for start in dict.fromkeys([found.tokens if found is not None else 0, 0]):
                if self.media_prefill.fits(starts + [start], lengths + [n - start]):
                    if found is not None:
                        del found.entries[start // BLOCK :]
                        self.prefix.load(seq.slot, found)
                    starts, lengths, ran = starts + [start], lengths + [n - start], ran + [seq]
                    break
        return ran, starts

    def _prefill_media(self, seqs: list[Sequence], starts: list[int], rows: list[InputRows], kept: dict
                       ) -> list[StepResult]:  # fmt: skip
        """Prompts with media rows, each after its kept prefix, with the step's other fresh prompts, in one
        MediaPrefill forward (stages/media_prefill.py); the talker's conditioning takes the kept prefix's
        media rows and that forward's rows for the rest, and the media prompts' blocks are kept for later
        prompts with that media."""
        last = self.media_prefill.run(rows, [s.slot for s in seqs], starts)
        tokens = self._sample(self.model.lm_head(last), seqs)
        text_rows = self._text_rows(tokens, seqs)
        results = []
        for i, (seq, start, token, r) in enumerate(zip(seqs, starts, tokens.tolist(), rows)):
            n, found = self.prompt_tokens(seq), kept.get(id(seq))
            embeds, hidden = r.embeds, self.media_prefill.accept_out[i, : n - start]
            if start:  # the kept prefix's rows: layer-0 embeddings, its media rows' kept accept-layer states
                head = self._embed(seq.payload.input_ids[:start])
                hidden = torch.cat([self.media_prefix.kept_rows(seq.payload, head, found), hidden])
                embeds = torch.cat([head, embeds])
            if found is not None:  # before the first token is accepted: it may end the turn (keep_turn)
                self.media_prefix.store(seq, found, hidden)
            results.append(self._prefilled_text(seq, n, token, embeds, hidden, text_rows, i, rope_delta=r.rope_delta,
                                                cached=start))
        return results

    def _start(self, seqs: list[Sequence]) -> dict:
        """A prompt's first piece starts its slot afresh (a resumed one from its generated tokens, one with a
        kept prefix from that prefix). Returns the prefix matches taken, by id(seq)."""
        taken = {}
        for seq in seqs:
            if seq.first_piece:
                self.cache.release(seq.slot)
                self.long_media.pop(seq.slot, None)
                if seq.num_generated:
                    self._resume(seq)
                if seq.prefix:
                    taken[id(seq)] = self._take_prefix(seq)
        return taken

    def _long_pieces(self, seqs: list[Sequence]) -> tuple[list[tuple[InputRows, int, int]], list[tuple[int, int, int]]]:
        """This step's piece of each prompt (Sequence.piece) for the LongPrefill: a text prompt's rows
        embedded now, a media prompt's cut from those kept since its first piece. The slot of each holds a
        stand-in state whose length is the piece's end, so that decode steps write their unused row there,
        where the next piece writes first (see StaticDecoder.step). Returns the pieces and their spans
        (start, end, prompt length)."""
        pieces, spans = [], []
        for s in seqs:
            n = self.prompt_tokens(s)
            a, b = s.piece(n)
            spans.append((a, b, n))
            state = self.long_media.get(s.slot)
            rows = InputRows(self._embed(s.payload.input_ids[a:b])) if state is None else state.rows.cut(
                a - state.start, b - state.start)  # fmt: skip
            pieces.append((rows, s.slot, a))
            self._pending(s, b)
        return pieces, spans

    def _media_pieces(self, seqs: list[Sequence]
                      ) -> tuple[list[tuple[InputRows, int, int]], list[tuple[int, int, int]]]:  # fmt: skip
        """A step's media prompts as decode()'s long pieces, one each: each slot takes its kept prefix, their
        media go through the encoders together, and each one's rows from there on are its piece, answered as
        a long media prompt's last piece (the pieces and spans of _long_pieces)."""
        starts, kept = [], []
        for seq in seqs:
            p = seq.payload
            found, start = self.media_prefix.match(p) if self.prefix else None, 0
            if found is not None and found.entries:
                found = self.media_prefix.still_kept(p, found)
                self.prefix.load(seq.slot, found)
                start = found.tokens
            starts.append(start)
            kept.append(found)
        pieces, spans = [], []
        for seq, rows, start, found in zip(seqs, self.media.rows([s.payload for s in seqs], starts), starts, kept):
            n = self.prompt_tokens(seq)
            self.long_media[seq.slot] = LongMedia(rows, start, found)
            self._pending(seq, n)
            pieces.append((rows, seq.slot, start))
            spans.append((start, n, n))
        return pieces, spans

    def _long_results(self, seqs: list[Sequence], spans: list[tuple[int, int, int]], last: torch.Tensor,
                      accepted: list[torch.Tensor | None]) -> list[StepResult]:  # fmt: skip
        """After the LongPrefill ran the pieces: a piece that ends its prompt picks the first token (and keeps
        the prompt's blocks: a media prompt's with its rows, a text prompt's on probation for the next turn);
        one that does not answers without output."""
        results, ending = [], []
        for i, (s, (a, b, n)) in enumerate(zip(seqs, spans)):
            if accepted[i] is not None:
                self.long_media[s.slot].accepted.append(accepted[i])
            results.append(StepResult(s, None))
            if b == n:
                ending.append(i)
        if ending:
            done = [seqs[i] for i in ending]
            tokens = self._sample(self.model.lm_head(last[ending]), done)
            text_rows = self._text_rows(tokens, done)
            for j, (i, token) in enumerate(zip(ending, tokens.tolist())):
                results[i] = self._ended_long(seqs[i], token, text_rows, j)
                if self.prefix and seqs[i].payload.is_text_only:  # kept for the next turn
                    match = self.prefix.peek(seqs[i].payload.input_ids.tolist())
                    self.prefix.store(seqs[i].slot, match, first_sighting=True)
        return results

    def _ended_long(self, seq: Sequence, token: int, text_rows, j: int) -> StepResult:
        """A long prompt's last piece ran: its talker conditioning's rows (a text prompt's embeddings stand in
        for the accept layer's states; a media prompt's media rows take those its pieces kept) and, for a
        media prompt, its blocks kept with those rows."""
        p, n = seq.payload, self.prompt_tokens(seq)
        state = self.long_media.pop(seq.slot, None)
        if state is None:  # the whole prompt's embeddings only for a talker's conditioning
            e = self._embed(p.input_ids) if p.export_talker and not p.resumed_from else None
            return self._prefilled_text(seq, n, token, e, e, text_rows, j)
        head = self._embed(p.input_ids[: state.start])  # [start, D] the kept prefix's layer-0 rows
        rows = state.rows
        hidden = rows.embeds.clone()
        if state.accepted:
            hidden.index_copy_(0, to_device(rows.media, hidden.device), torch.cat(state.accepted).to(hidden.dtype))
        embeds = torch.cat([head, rows.embeds])
        hidden = torch.cat([self.media_prefix.kept_rows(p, head, state.found), hidden])
        if state.found is not None:
            self.media_prefix.store(seq, state.found, hidden)
        return self._prefilled_text(seq, n, token, embeds, hidden, text_rows, j, rope_delta=rows.rope_delta,
                                    cached=state.start)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(to_device(ids, self.device))  # [L, D]
