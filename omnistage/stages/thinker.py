# ThinkerRunner: owns the thinker's weights, its paged KV cache and per-slot decode state. Prefill batches
# the step's prompts by kind (see prefill()), writing their K/V into their slots' blocks; decode batches
# every running request. A sequence preempted for memory (core/scheduler.py) comes back as a prompt of its
# original prompt and the tokens it had generated, and goes on from there.
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..core.block_pool import BLOCK
from ..core.engine import StepResult
from ..core.errors import BadRequestError
from ..core.scheduler import Sequence
from .chunk_prefill import ChunkPrefill
from .conditioning import TalkerConditioning
from .host_copy import outputs_to_host, to_device, to_host
from .media_prefill import MediaPrefill
from .media_prefix import MediaPrefixPrefill
from .prefix_cache import PrefixCache
from .runner import WARM_UP_STEPS, DecoderRunner
from .warm_up import warm_up_turns


@dataclass
class ThinkerPrompt:
    input_ids: torch.Tensor  # [L] long
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    export_talker: bool = False  # also produce what the talker needs
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None  # [videos] seconds of video per temporal grid step
    use_audio_in_video: bool = False  # the videos' audio tracks are interleaved with their frames
    # a preempted sequence's prompt when it comes back: the original prompt's length (input_ids then go on
    # with the tokens it had generated, recomputed in its prefill); 0: a first prefill
    resumed_from: int = 0
    # derived from the media at admission (ThinkerRunner.validate, on the caller's thread), so that the
    # engine's steps do not hash a picture's patches or walk get_rope_index's host loops while others wait
    salts: dict[int, bytes] | None = None  # the media's content digests by block (MediaPrefixPrefill.salts)
    rope: tuple[torch.Tensor, int] | None = None  # MRoPE positions [3, L] and rope delta (MediaPrefill.rope_index)

    @property
    def is_text_only(self) -> bool:
        return self.pixel_values is None and self.input_features is None and self.pixel_values_videos is None


@dataclass
class ThinkerOutput:
    token_ids: list[int] = field(default_factory=list)
    text_rows: torch.Tensor | None = None  # [n, D] input embeddings of token_ids (export_talker only)
    talker: TalkerConditioning | None = None  # first output only
    prompt_tokens: int | None = None  # first output only
    cached_tokens: int | None = None  # first output only: prompt tokens whose K/V came from the prefix cache

    def merge(self, later: ThinkerOutput) -> ThinkerOutput:
        rows = [r for r in (self.text_rows, later.text_rows) if r is not None]
        return ThinkerOutput(
            token_ids=self.token_ids + later.token_ids,
            text_rows=torch.cat(rows) if rows else None,
            talker=self.talker or later.talker,
            prompt_tokens=self.prompt_tokens if self.prompt_tokens is not None else later.prompt_tokens,
            cached_tokens=self.cached_tokens if self.cached_tokens is not None else later.cached_tokens,
        )


@dataclass
class _SlotState:
    length: int  # tokens in the cache
    rope_delta: int
    last_token: int


class ThinkerRunner(DecoderRunner):
    STAGE = "thinker"
    RECOMPUTES = True  # a preempted sequence can be recomputed from its prompt and generated tokens

    def __init__(self, model, config, *, max_slots: int, max_seq_len: int, device, dtype, seed: int = 0,
                 cuda_graphs: bool = False, max_prefills: int = 16, prefix_cache_bytes: int = 0,
                 kv_cache_bytes: int | None = None):  # fmt: skip
        super().__init__(model, config, config.thinker_config.text_config, max_slots=max_slots,
                         max_seq_len=max_seq_len, device=device, dtype=dtype, seed=seed, cuda_graphs=cuda_graphs,
                         max_prefills=max_prefills, head=model.lm_head, embed=model.get_input_embeddings(),
                         kv_cache_bytes=kv_cache_bytes)  # fmt: skip
        # prompts with audio/image rows prefill batched, with the step's other fresh prompts
        self.media_prefill = MediaPrefill(self.STAGE, model, self.cache, max_rows=self.static_prefill.max_rows,
                                          max_tokens=self.static_prefill.max_tokens,
                                          accept_layer=config.talker_config.accept_hidden_layer,
                                          cuda_graphs=cuda_graphs)  # fmt: skip
        # text-only prompts that start like earlier ones take the kept prefix's K/V and prefill only the rest
        self.prefix = PrefixCache(self.cache, prefix_cache_bytes) if prefix_cache_bytes else None
        self.chunk_prefill = (ChunkPrefill("thinker", model.model, self.cache, max_rows=min(max_prefills, max_slots),
                                           cuda_graphs=cuda_graphs) if self.prefix else None)  # fmt: skip
        # kept prefixes of prompts with media, keyed by the media's content; the prefill of prompts with video
        # (media_prefix.py)
        self.media_prefix = MediaPrefixPrefill(self)
        self.eos_ids = {config.im_end_token_id, 151643}  # <|im_end|>, <|endoftext|>
        self.accept_layer = config.talker_config.accept_hidden_layer
        t = config.thinker_config
        self.mm_ids = torch.tensor([t.audio_token_id, t.image_token_id, t.video_token_id])  # host: see _talker_conditioning
        self.tts_ids = torch.tensor(
            [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id], device=self.device
        )

    # ---- engine hooks -------------------------------------------------------------------------------------
    def prompt_tokens(self, seq: Sequence) -> int:
        """Its prompt's length; a preempted sequence's prompt goes on with the tokens it had generated."""
        p = seq.payload
        if not seq.num_generated:
            return int(p.input_ids.numel())
        return (p.resumed_from or int(p.input_ids.numel())) + len(seq.generated)

    def _text_only(self, seq: Sequence) -> bool:
        return seq.payload.is_text_only

    def prefix_blocks(self, seq: Sequence) -> list[int]:
        """The kept prefix a waiting text-only prompt in chunks starts with (core/scheduler.py): its pool
        blocks, as far as its chunk rows allow (LongPrefill.usable_prefix). A conversation's next turn finds
        its earlier turns here: a long prompt's blocks are kept after its prefill (see prefill())."""
        if self.prefix is None or not self._in_chunks(seq):
            return []
        ids = self._prompt_ids(seq)
        found = self.prefix.peek(ids.tolist())
        return found.entries[: self.long_prefill.usable_prefix(found.tokens, ids.numel()) // BLOCK]

    def validate(self, seq: Sequence) -> None:
        length = self.prompt_tokens(seq)
        if length == 0:
            raise BadRequestError("empty prompt")
        seq.params = seq.params.fit_to_context(length, self.context)
        p = seq.payload
        if not p.is_text_only:
            self.media_prefill.validate(p)
            if self.prefix is not None:
                p.salts = self.media_prefix.salts(p, p.input_ids.cpu())
            if self._media_batches(seq):
                p.rope = self.media_prefill.rope_index(p)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[StepResult]:
        """Every prompt of a step, one of five ways, the first four graph-replayed on CUDA: prompts whose kept
        prefix leaves only text to run (text-only prompts after a shared prefix, prompts whose kept prefix
        covers all their media) prefill that text (ChunkPrefill); audio/image prompts that fit the static
        buffers, each after its kept prefix (a system prompt, earlier turns), joined by the step's other fresh
        prompts while rows remain, in one MediaPrefill forward; other text-only prompts that fit the static
        buffers together (StaticPrefill); longer text-only prompts in chunks after the kept prefix they were
        admitted with, this step's piece of each (LongPrefill). Prompts with video and media prompts too long
        for the buffers run one by one through MediaPrefixPrefill, eager. A piece that does not end its prompt
        answers with a StepResult without output. Long prompts keep their blocks for a conversation's next
        turn once their last piece ran (on probation: core/prefix_index.py)."""
        for seq in seqs:  # a prompt's first piece starts its slot afresh (resumed ones from their generated tokens)
            if seq.first_piece:
                self.cache.release(seq.slot)
                if seq.num_generated:
                    self._resume(seq)
                if seq.prefix:
                    self._take_prefix(seq)
        text = [s for s in seqs if s.payload.is_text_only]
        # prompts the chunk prefill could serve look up their prefixes here; longer ones took theirs at
        # admission (prefix_blocks)
        found = {id(s): self.prefix.match(s.payload.input_ids.tolist()) for s in text
                 if s.payload.input_ids.numel() <= self.chunk_prefill.max_kv} if self.prefix else {}  # fmt: skip
        kept = {id(s): self.media_prefix.match(s.payload, self._media_batches(s)) for s in seqs
                if not s.payload.is_text_only}  # fmt: skip
        covered = {id(s): kept[id(s)] for s in seqs if self.media_prefix.covers_media(s.payload, kept.get(id(s)))}
        hits = self._chunk_hits([s for s in seqs if id(s) in found or id(s) in covered], found | covered)
        fresh = [s for s in text if all(s is not h for h in hits)
                 and s.payload.input_ids.numel() <= self.static_prefill.max_tokens][: self.static_prefill.max_rows]
        rows = self.media_prefill.max_rows
        media = [s for s in seqs if id(s) in kept and all(s is not h for h in hits) and self._media_batches(s)][:rows]
        joined = media + fresh[: rows - len(media)] if media else []
        fresh = [s for s in fresh if all(s is not j for j in joined)]
        results = (self._prefill_after_prefix(hits, found | covered) if hits else [])
        results += self._prefill_static(fresh) if fresh else []
        results += self._prefill_media(joined, kept) if joined else []
        batched = {id(r.seq) for r in results}
        results += [self.media_prefix.prefill(s, kept[id(s)]) for s in seqs
                    if id(s) not in batched and not s.payload.is_text_only]  # fmt: skip
        long = [s for s in text if id(s) not in batched]
        results += (long_results := self._prefill_long(long) if long else [])
        for seq in text:  # keep the blocks worth keeping (copied in stream order: after the prefill)
            if id(seq) in found:
                self.prefix.store(seq.slot, found[id(seq)])
        for r in long_results if self.prefix else []:  # a long prompt's blocks, kept for the next turn
            if r.output is not None:  # its last piece ran
                match = self.prefix.peek(r.seq.payload.input_ids.tolist())
                self.prefix.store(r.seq.slot, match, first_sighting=True)
        # the talker's conditioning was gathered after the tokens' sync: one more sync (none on the CPU)
        outputs_to_host([r.output for r in results if r.output is not None], self.device)
        return results

    def _resume(self, seq: Sequence) -> None:
        """The sequence was preempted after generating seq.generated: its prompt becomes the original prompt and
        those tokens, whose prefill picks its next token as its next decode step would have."""
        original = seq.payload.resumed_from or int(seq.payload.input_ids.numel())
        # what admission derived from the original prompt does not hold for the longer one
        seq.payload = replace(seq.payload, input_ids=self._prompt_ids(seq), resumed_from=original, salts=None,
                              rope=None)  # fmt: skip

    def _prompt_ids(self, seq: Sequence) -> torch.Tensor:
        """The token ids its prefill runs over, on the host: a preempted sequence's go on with the tokens it
        had generated."""
        p = seq.payload
        if not seq.num_generated:
            return p.input_ids.cpu()
        original = p.resumed_from or int(p.input_ids.numel())
        return torch.cat([p.input_ids[:original].cpu(), torch.tensor(seq.generated, dtype=p.input_ids.dtype)])

    def _take_prefix(self, seq: Sequence) -> None:
        """The slot of a prompt in chunks starts with the kept prefix it was admitted with (seq.prefix). Its
        blocks are kept still (nothing evicts between the schedule and this prefill); should fewer be, its
        first piece starts where they end."""
        found = self.prefix.match(seq.payload.input_ids.tolist())
        del found.entries[len(seq.prefix) :]
        self.prefix.load(seq.slot, found)
        if found.entries != seq.prefix:
            seq.chunk += seq.cached - found.tokens
            seq.prefix = found.entries

    def _media_batches(self, seq: Sequence) -> bool:
        """Whether a prompt with media takes the batched MediaPrefill in full: audio/image prompts that fit its
        buffers. It has no video encoder and no audio-in-video interleave."""
        p = seq.payload
        if p.pixel_values_videos is not None or p.use_audio_in_video:
            return False
        return self.prompt_tokens(seq) <= self.media_prefill.max_tokens

    def _warm_up_batches(self) -> list[list[ThinkerPrompt]]:
        """A text turn alone (StaticPrefill), then an audio and an image turn together (MediaPrefill and both
        encoders), each feeding a talker (its conditioning is built too); those longer than the slots or
        the media buffers are left out."""
        turns = [ThinkerPrompt(torch.tensor(t.ids), t.pixel_values, t.image_grid_thw, t.input_features,
                               t.feature_attention_mask, export_talker=True)
                 for t in warm_up_turns(self.config)]  # fmt: skip
        fits = lambda p: p.input_ids.numel() + WARM_UP_STEPS < min(self.context, self.media_prefill.max_tokens)  # noqa: E731
        return [[turns[0]], [p for p in turns[1:] if fits(p)]]

    @torch.inference_mode()
    def warm_up(self) -> None:
        prefix, self.prefix = self.prefix, None  # the synthetic prompt is not one to keep
        try:
            super().warm_up()
        finally:
            self.prefix = prefix

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        super().capture_graphs()
        # the two prefills' graphs replay one at a time on one stream and leave their results in buffers
        # outside the pool, so they can share one pool of intermediates instead of holding two
        self.media_prefill.bank.pool = self.static_prefill.bank.pool
        self.media_prefill.capture_all()
        if self.chunk_prefill is not None:
            self.chunk_prefill.capture_all()

    def stats(self) -> dict:
        p = self.prefix
        return {"prefix_hit_tokens": p.hit_tokens if p else 0, "prefix_prompt_tokens": p.prompt_tokens if p else 0}

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[StepResult]:
        # every occupied slot up to the highest takes part (a just-prefilled one too), see StaticDecoder.step
        for seq in seqs:
            self.cache.grow(seq.slot, self.slots[seq.slot].length + 1)
        states = self._step_states()
        self.decoder.step([s.length if s else 0 for s in states], [s.rope_delta if s else 0 for s in states],
                          [s.last_token if s else 0 for s in states])  # fmt: skip
        slots = to_device([s.slot for s in seqs], self.device)
        tokens = self._sample(self.decoder.logits_out[slots], seqs)
        rows = self._text_rows(tokens, seqs)
        if rows is not None:  # complete at tokens.tolist(), the step's one sync
            rows = to_host(rows)
        results = []
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            self.slots[seq.slot].length += 1
            results.append(self._accept(seq, token, None, None if rows is None else rows[i : i + 1]))
        return results

    # ---- internals ----------------------------------------------------------------------------------------
    def _prefill_long(self, seqs: list[Sequence]) -> list[StepResult]:
        """Text-only prompts too long for the static prefill: this step's piece of each (Sequence.piece)
        through the LongPrefill. A piece that ends its prompt picks the first token; the slot of one that
        does not holds a stand-in state whose length is the piece's end, so that decode steps meanwhile
        write their unused row there, where the next piece writes first (see StaticDecoder.step)."""
        embed = self.model.get_input_embeddings()
        embeds = [embed(to_device(s.payload.input_ids, self.device)) for s in seqs]  # [L_i, D]
        pieces = [s.piece(e.shape[0]) for s, e in zip(seqs, embeds)]
        last = self.long_prefill.run([(e[a:b], s.slot, a) for s, e, (a, b) in zip(seqs, embeds, pieces)])
        ending = [i for i, (e, (_, b)) in enumerate(zip(embeds, pieces)) if b == e.shape[0]]
        results = []
        for s, (_, b) in zip(seqs, pieces):
            self.slots[s.slot] = _SlotState(b, 0, 0)
            results.append(StepResult(s, None))
        if ending:
            done = [seqs[i] for i in ending]
            tokens = self._sample(self.model.lm_head(last[ending]), done)
            rows = self._text_rows(tokens, done)
            for j, (i, token) in enumerate(zip(ending, tokens.tolist())):
                e = embeds[i]  # no audio/image rows: the embeddings stand in for the accept layer's states
                results[i] = self._prefilled_text(seqs[i], e.shape[0], token, e, e, rows, j)
        return results

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

    def _prefill_static(self, seqs: list[Sequence]) -> list[StepResult]:
        """Text-only prompts through the static prefill (stages/static_prefill.py). The talker's conditioning
        of a text-only prompt needs only its input embeddings (no audio/image rows take hidden states)."""
        embeds = [self._embed(s) for s in seqs]
        last = self.static_prefill.run(embeds, [s.slot for s in seqs])
        tokens = self._sample(self.model.lm_head(last), seqs)
        rows = self._text_rows(tokens, seqs)
        # no audio/image rows, so the accept layer's hidden states are never read: the embeddings stand in
        return [self._prefilled_text(seq, e.shape[0], token, e, e, rows, i)
                for i, (seq, e, token) in enumerate(zip(seqs, embeds, tokens.tolist()))]  # fmt: skip

    def _prefill_after_prefix(self, seqs: list[Sequence], found: dict) -> list[StepResult]:
        """Prompts whose kept prefix (`found`) leaves only text: that text through the chunk prefill
        (stages/chunk_prefill.py), at the prompt's rope delta (text after media sits at its index plus the
        delta on every MRoPE section). The talker's conditioning of a prompt with media takes its media rows'
        accept-layer hidden states kept with the prefix (the layer-0 embeddings on text rows)."""
        embeds = [self._embed(s) for s in seqs]
        deltas = [0 if s.payload.is_text_only else self.media_prefill.rope_index(s.payload)[1] for s in seqs]
        for s in seqs:
            self.prefix.load(s.slot, found[id(s)])
        starts = [found[id(s)].tokens for s in seqs]  # as loaded
        last = self.chunk_prefill.run([e[p:] for e, p in zip(embeds, starts)], [s.slot for s in seqs], starts, deltas)
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

    def _embed(self, seq: Sequence) -> torch.Tensor:
        return self.model.get_input_embeddings()(to_device(seq.payload.input_ids, self.device))  # [L, D]

    def _prefill_media(self, seqs: list[Sequence], kept: dict) -> list[StepResult]:
        """Prompts with audio/image rows, each after its kept prefix (`kept`: their prefix matches), with the
        step's other fresh prompts, in one MediaPrefill forward (stages/media_prefill.py); the talker's
        conditioning takes the kept prefix's media rows and that forward's rows for the rest, and the media
        prompts' blocks are kept for later prompts with that media. A prompt whose prefix would stretch the
        step past the buffers prefills in full; one that does not fit even so is left to the eager path."""
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
        if not ran:
            return []
        last, deltas = self.media_prefill.run([s.payload for s in ran], [s.slot for s in ran], starts)
        tokens = self._sample(self.model.lm_head(last), ran)
        rows = self._text_rows(tokens, ran)
        results = []
        for i, (seq, start, token, delta) in enumerate(zip(ran, starts, tokens.tolist(), deltas)):
            n, found = self.prompt_tokens(seq), kept.get(id(seq))
            embeds = self.media_prefill.embeds_out(i, n - start)  # a static buffer, rewritten by the next step
            hidden = self.media_prefill.accept_out[i, : n - start]
            if start:  # the kept prefix's rows: layer-0 embeddings, its media rows' kept accept-layer states
                head = self.model.get_input_embeddings()(to_device(seq.payload.input_ids[:start], self.device))
                hidden = torch.cat([self.media_prefix.kept_rows(seq.payload, head, found), hidden])
                embeds = torch.cat([head, embeds])
            if found is not None:  # before the first token is accepted: it may end the turn (keep_turn)
                self.media_prefix.store(seq, found, hidden)
            results.append(self._prefilled_text(seq, n, token, embeds.clone(), hidden, rows, i, rope_delta=delta,
                                                cached=start))
        return results

    def _prefilled_text(self, seq: Sequence, n: int, token: int, embeds, hidden, rows, i: int,
                        rope_delta: int = 0, cached: int = 0) -> StepResult:  # fmt: skip
        """A prompt of n tokens is in its slot and its first token picked: the slot's state, the talker's
        conditioning when it feeds one (embeds / hidden: its rows, see _talker_conditioning), and row i of
        `rows` (the first token's text row, or None); `cached` of its tokens came from the prefix cache."""
        self.slots[seq.slot] = _SlotState(n, rope_delta, 0)
        talker = tail = None
        resumed = seq.payload.resumed_from
        if seq.payload.export_talker and not resumed:
            talker, tail = self._talker_conditioning(seq.payload.input_ids, embeds, hidden)
        output = ThinkerOutput(talker=talker, prompt_tokens=None if resumed else n, text_rows=tail,
                               cached_tokens=None if resumed else cached)
        return self._accept(seq, token, output, None if rows is None else rows[i : i + 1])

    def _text_rows(self, tokens: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """Input embeddings of the sampled tokens, [n, D] fp32, when any request feeds a talker."""
        if not any(s.payload.export_talker for s in seqs):
            return None
        return self.model.get_input_embeddings()(tokens).float()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        banned = [
            sorted(self.eos_ids | set(s.params.stop_token_ids))
            if s.num_generated < s.params.min_tokens and not s.params.ignore_eos
            else []
            for s in seqs
        ]
        return self.sampler.sample(
            logits, [s.request_id for s in seqs], [s.params for s in seqs], [s.generated for s in seqs], banned
        )

    def _accept(self, seq: Sequence, token: int, output: ThinkerOutput | None, row: torch.Tensor | None) -> StepResult:
        output = output or ThinkerOutput()
        seq.num_generated += 1
        self.slots[seq.slot].last_token = token
        stops = () if seq.params.ignore_eos else self.eos_ids
        finish = "stop" if token in stops or token in seq.params.stop_token_ids else None
        if finish is None:
            seq.generated.append(token)
            output.token_ids.append(token)
            if seq.payload.export_talker:
                output.text_rows = row if output.text_rows is None else torch.cat([output.text_rows, row])
            finish = "length" if seq.num_generated >= seq.params.max_tokens else None
        if finish and self.prefix is not None and not seq.payload.is_text_only:
            # its slot's blocks go when it ends: a conversation's next turn resends this one
            self.media_prefix.keep_turn(seq, self.slots[seq.slot].length)
        return StepResult(seq, output, finish)

    def _talker_conditioning(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
                             ) -> tuple[TalkerConditioning, torch.Tensor]:  # fmt: skip
        """What generate() hands the talker, for one prompt: user-turn rows (layer-0 embeddings, or the
        accept-layer hidden state on audio/image/video rows), the assistant header rows, the tts rows,
        and any prompt rows after the assistant header (spoken before the reply).
        `ids` are the prompt's token ids on the host: which rows go where is decided there, and the device
        only gathers. Each host sync here (a boolean mask, nonzero) would wait for a turn on a GPU that
        the other stage processes share, once per prompt."""
        c = self.config  # embeds: layer-0 input embeddings [L, D]; hidden: the accept layer's hidden states
        ids = ids.cpu()
        pos = torch.arange(ids.numel())
        starts = torch.where(ids == c.im_start_token_id, pos, torch.full_like(pos, -1))
        role = ids[(torch.cummax(starts, 0).values.clamp_min(0) + 1).clamp_max(ids.numel() - 1)]
        user = (role == c.user_token_id).nonzero().squeeze(1)
        is_mm = torch.isin(ids, self.mm_ids)
        header = ((ids[:-1] == c.im_start_token_id) & (ids[1:] == c.assistant_token_id)).nonzero()
        if header.numel() == 0:
            raise BadRequestError("prompt has no assistant header (<|im_start|>assistant) for the talker")
        a = int(header[-1])
        user_dev = to_device(user, self.device)
        user_is_mm = is_mm[user]
        rows = torch.where(to_device(user_is_mm, self.device)[:, None], hidden.index_select(0, user_dev),
                           embeds.index_select(0, user_dev))  # fmt: skip
        tts = self.model.get_input_embeddings()(self.tts_ids)
        cond = TalkerConditioning(
            user_rows=rows.float(),
            user_is_mm=user_is_mm,
            user_ids=ids[user],
            special_rows=torch.cat([embeds[a : a + 3], tts]).float(),
        )
        return cond, embeds[a + 3 :].float()

