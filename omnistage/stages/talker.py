# TalkerRunner: codec frames from the thinker's conditioning, one frame per decode step for every ready
# request. A request's text arrives in pieces while the thinker is still running (async chunk). A frame
# takes two parts: the talker reads frame k-1 back with reply-token row k-1 and picks frame k's codebook 0,
# then the code predictor completes frame k. A step does both, in that order, so frame k goes out as soon
# as row k-1 is in, and the sequence then waits for row k: the audio runs one reply token ahead of the
# thinker instead of behind it. Frame 0's codebook 0 comes from the prefill, which completes that frame in
# the same step. Frames leave in host memory, copied at the step's own sync (see stages/thinker.py).
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.engine import StepResult
from ..core.errors import BadRequestError
from ..core.scheduler import Sequence
from .code_predictor import CodePredictor, StaticCodePredictor
from .host_copy import sync_current_stream, to_device, to_host
from .conditioning import ASSISTANT_ROWS, TalkerConditioning
from .long_prefill import ROWS_BESIDE
from .media_rows import InputRows
from .positioned_prefill import PositionedPrefill
from .runner import WARM_UP_STEPS, DecoderRunner
from .talker_prompt import PromptBuilder, PromptRows, TalkerPrompt
from .warm_up import warm_up_turns


@dataclass
class TalkerOutput:
    codes: torch.Tensor  # [frames, 16] long

    def merge(self, later: TalkerOutput) -> TalkerOutput:
        return TalkerOutput(torch.cat([self.codes, later.codes]))


@dataclass
class _SlotState:
    length: int
    rope_delta: int
    tts_eos: torch.Tensor  # [D] projected rows fed after the text, once, then forever
    tts_pad: torch.Tensor
    frames: int = 0
    unfed: bool = False  # frame `frames` is complete and sent, but not yet read back with its text row


class TalkerRunner(DecoderRunner):
    STAGE = "talker"
    # a frame's input is the previous frame's codes, which leave with the response: a preempted sequence
    # could not be recomputed, so the scheduler reserves a talker sequence's whole reply when it admits it
    RECOMPUTES = False

    def __init__(self, model, config, text_embeddings: torch.Tensor, *, max_slots: int, max_seq_len: int, device,
                 dtype, seed: int = 0, cuda_graphs: bool = False, max_prefills: int = 16,
                 kv_cache_bytes: int | None = None):  # fmt: skip
        tc = config.talker_config
        text = tc.text_config
        super().__init__(model, config, text, max_slots=max_slots, max_seq_len=max_seq_len, device=device,
                         dtype=dtype, seed=seed, cuda_graphs=cuda_graphs, max_prefills=max_prefills,
                         head=model.codec_head, embed=None, kv_cache_bytes=kv_cache_bytes)  # fmt: skip
        self.hidden = torch.zeros(max_slots, text.hidden_size, dtype=dtype, device=self.device)  # last normed hidden
        self.codec_sums = torch.zeros_like(self.hidden)  # each unfed frame's summed codebook embeddings
        self.c0 = torch.zeros(max_slots, dtype=torch.long, device=self.device)  # next frame's codebook 0
        self.predictor = CodePredictor(model, self.device, dtype)
        # with graphs requested, residual codebooks are picked in-graph (on CPU the same code runs eagerly);
        # without, per-request generators keep seeded sampling reproducible
        self.static_predictor = (
            StaticCodePredictor(self.predictor, max_slots, text.hidden_size, cuda_graphs) if cuda_graphs else None
        )
        self.eos = tc.codec_eos_token_id
        self.suppress = torch.zeros(text.vocab_size, dtype=torch.bool, device=self.device)
        self.suppress[text.vocab_size - 1024 :] = True  # codec specials are never sampled, except EOS
        self.suppress[self.eos] = False
        # the thinker's embedding table [vocab, D]: the user turns' text rows are looked up here, so that the
        # thinker hands over only its media rows (a 30k-token prompt's rows would be ~250 MB in float32)
        self.text_embeddings = text_embeddings.to(device=self.device, dtype=dtype)
        self.prompts = PromptBuilder(model, config, self.text_embeddings, self.device, dtype, self.context)
        self.long_prompts: dict[int, PromptRows] = {}  # slot -> its prompt's rows, while prefilled in pieces
        self.prompts_in_decode = 0  # prompts prefilled in a decode step's forward (decode()'s riders)
        # steps with prompts from media turns (their rows take MRoPE positions of their own) prefill batched too
        self.media_prefill = PositionedPrefill(f"{self.STAGE}_media", model.model, self.cache,
                                               max_rows=self.static_prefill.max_rows,
                                               max_tokens=self.static_prefill.max_tokens, cuda_graphs=cuda_graphs)  # fmt: skip

    # ---- engine hooks -------------------------------------------------------------------------------------
    def prompt_tokens(self, seq: Sequence) -> int:
        return int(seq.payload.cond.user_ids.numel()) + ASSISTANT_ROWS

    def validate(self, seq: Sequence) -> None:
        p: TalkerPrompt = seq.payload
        length = self.prompt_tokens(seq)
        seq.params = seq.params.fit_to_context(length, self.context - 1)  # -1: the frame after the last one's
        if not p.text:
            raise BadRequestError("talker start needs at least one text row")
        if p.has_media:
            p.rope = self.prompts.rope_index(p)

    def is_ready(self, seq: Sequence) -> bool:
        state = self.slots[seq.slot]
        if state is None:
            return False
        # the next frame can be completed once the last one is read back with text row `frames` (after the
        # text: tts_eos, then tts_pad), so a sequence with an unfed frame waits for that row
        return not state.unfed or seq.payload.text_end or state.frames < len(seq.payload.text)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.long_prompts.pop(seq.slot, None)

    def riders(self, seqs: list[Sequence]) -> list[Sequence]:
        """The prompts of a step that prefill in its decode forward (decode()'s riders): all of its new ones,
        when at most ROWS_BESIDE[-1] come and none goes in chunks (a long prefill row each). One forward
        then reads each layer's experts for the prompts and the decode rows, and one code-predictor call
        completes the decode's frames and the prompts' frame 0, where a prefill of their own took a forward
        and a predictor call more."""
        if len(seqs) > ROWS_BESIDE[-1] or any(self._in_chunks(s) for s in seqs):
            return []
        return seqs

    def stats(self) -> dict:
        return {"prompts_in_decode": self.prompts_in_decode}

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[StepResult]:
        """The step's prompts: those that fit the static buffers together, text-only ones through the
        StaticPrefill, any mix with media rows through the MediaPrefill (per-row MRoPE positions); longer
        ones, and any beyond the buffers' rows, in chunks, this step's piece of each (LongPrefill). A piece
        that does not end its prompt answers with a StepResult without output."""
        short = [s for s in seqs if not self._in_chunks(s)]
        whole = short[: self.static_prefill.max_rows]
        kept = {id(s) for s in whole}
        long = [s for s in seqs if id(s) not in kept]
        results = self._prefill_batch(whole) if whole else []
        results, pending = (results, []) if not long else self._prefill_long(long, results)
        # frame 0 needs nothing but the prefill's codebook-0 pick: completed now, a step earlier than a decode
        # step would (the time to first audio), at the cost of one more sync
        going = [i for i, r in enumerate(results) if r.finish_reason is None]
        if going:
            codes = self._complete_frames([results[i].seq for i in going])
            sent = to_host(codes)
            sync_current_stream(self.device)
            for j, i in enumerate(going):
                results[i] = self._frame_sent(results[i].seq, sent[j : j + 1])
        return results + pending

    def _warm_up_batches(self) -> list[list[TalkerPrompt]]:
        """The conditioning of a text turn alone, then of an audio, an image and a video turn together (stages/
        warm_up.py), each with a reply of as many rows as the warm-up has steps; those longer than the slots
        are left out."""
        c = self.config
        width = c.thinker_config.text_config.hidden_size  # the thinker's rows, before projection
        t = c.thinker_config
        mm = torch.tensor([t.audio_token_id, t.image_token_id, t.video_token_id])
        speaker = next(iter(c.talker_config.speaker_id.values()))
        prompts = []
        for turn in warm_up_turns(c):
            ids = turn.user_ids()
            is_mm = torch.isin(ids, mm)
            cond = TalkerConditioning(torch.zeros(int(is_mm.sum()), width), is_mm, ids, torch.zeros(6, width))
            lengths = turn.feature_attention_mask.sum(-1) if turn.feature_attention_mask is not None else None
            prompts.append(TalkerPrompt(cond, speaker, [torch.zeros(width)] * (WARM_UP_STEPS + 1), text_end=True,
                                        image_grid_thw=turn.image_grid_thw, audio_feature_lengths=lengths,
                                        video_grid_thw=turn.video_grid_thw,
                                        video_second_per_grid=turn.video_second_per_grid))  # fmt: skip
        fits = [p for p in prompts if p.cond.user_ids.numel() + 10 + WARM_UP_STEPS < self.context]
        return [fits[:1], fits[1:]]

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        super().capture_graphs()
        # the two prefills' graphs replay one at a time on one stream and leave their results in buffers
        # outside the pool, so they share one pool of intermediates (as the thinker's do)
        self.media_prefill.bank.pool = self.static_prefill.bank.pool
        self.media_prefill.capture_all()
        self.long_prefill.capture_beside(self.decoder)  # the prompts that ride decode steps (riders())
        if self.static_predictor is not None:
            self.static_predictor.capture_all()

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], riders: list[Sequence] = ()) -> list[StepResult]:
        """One frame of each of seqs: read back the frames sent by earlier steps (their rows are in: is_ready),
        then complete the next frame of every sequence, with one sync at the end for the picked tokens and the
        frames' host copy. riders (riders()): prompts prefilled in the read-back's forward where a captured
        shape takes them, their frame 0 completed with the others; else prefilled first, as prefill() does."""
        unfed = [s for s in seqs if self.slots[s.slot].unfed]
        prompts = self._ride(riders) if riders and unfed else None
        if riders and prompts is None:
            return self.prefill(list(riders)) + self.decode(seqs)
        riders = list(riders)
        picked = self._advance(unfed, riders, prompts or []) if unfed else None
        codes = self._complete_frames(seqs + riders)
        # a frame completed from an EOS pick is dropped below; until the sync only views of the copy are taken
        sent = to_host(codes)
        picks = unfed + riders
        tokens = dict(zip(map(id, picks), picked.tolist())) if picks else {}
        if not picks:
            sync_current_stream(self.device)
        results = []
        for i, seq in enumerate(seqs + riders):
            if id(seq) in tokens:
                stop = self._accept(seq, tokens[id(seq)])
                if stop.finish_reason is not None:
                    results.append(stop)  # EOS: the frame just completed from it is not one
                    continue
            results.append(self._frame_sent(seq, sent[i : i + 1]))
        return results

    def _ride(self, riders: list[Sequence]) -> list[PromptRows] | None:
        """The riders' prompts, their slots started with stand-in states (a decode step's row of such a slot
        writes past its prompt, where its first read-back writes), when the long prefill takes them beside
        this step's decode (LongPrefill.joins); None, and their slots as they were, when it does not."""
        prompts = self.prompts.build(riders)
        occupied = [i for i, st in enumerate(self.slots) if st is not None] + [s.slot for s in riders]
        lengths = [st.length for st in self.slots if st is not None] + [p.embeds.shape[0] for p in prompts]
        decode_shape = self.decoder.shape_for(1 + max(occupied), 1 + max(lengths))
        if not self.long_prefill.joins(_pieces(prompts, riders), decode_shape):
            return None
        for seq, p in zip(riders, prompts):  # a prefill starts its slot afresh
            self.cache.release(seq.slot)
            self.slots[seq.slot] = _SlotState(p.embeds.shape[0], 0, p.tts_eos, p.tts_pad)
        return prompts

    def _frame_sent(self, seq: Sequence, codes: torch.Tensor) -> StepResult:
        """The sequence's next frame (codes [1, 16]) is complete: it goes out, to be read back later."""
        state = self.slots[seq.slot]
        state.frames += 1
        state.unfed = True
        return StepResult(seq, TalkerOutput(codes), "length" if state.frames >= seq.params.max_tokens else None)

    # ---- internals ----------------------------------------------------------------------------------------
    def _prefill_batch(self, seqs: list[Sequence]) -> list[StepResult]:
        for seq in seqs:  # a prefill starts its slot afresh
            self.cache.release(seq.slot)
        prompts = self.prompts.build(seqs)
        lengths = [p.embeds.shape[0] for p in prompts]
        if all(p.text_only for p in prompts) and self.static_prefill.fits(len(seqs), max(lengths)):
            hidden = self.static_prefill.run([p.embeds for p in prompts], [s.slot for s in seqs])
        else:
            hidden = self.media_prefill.run([p.embeds for p in prompts], [s.slot for s in seqs],
                                            [p.positions for p in prompts])  # fmt: skip
        return self._prefilled(seqs, prompts, hidden)

    def _prefill_long(self, seqs: list[Sequence], results: list[StepResult]
                      ) -> tuple[list[StepResult], list[StepResult]]:  # fmt: skip
        """Prompts too long for the static prefill: this step's piece of each (Sequence.piece) through the
        LongPrefill, their rows (and MRoPE positions) built at the first piece and kept until the last. Returns
        `results` with those of the pieces that end their prompt, and the others' (no output). The slot of
        a prompt part-way holds a stand-in state whose length is the piece's end, so that decode steps
        meanwhile write their unused row there, where the next piece writes first."""
        for seq in seqs:  # a prompt's first piece starts its slot afresh
            if seq.piece(self.prompt_tokens(seq))[0] == 0:
                self.cache.release(seq.slot)
        fresh = [s for s in seqs if s.slot not in self.long_prompts]
        self.long_prompts.update(zip((s.slot for s in fresh), self.prompts.build(fresh) if fresh else []))
        prompts = [self.long_prompts[s.slot] for s in seqs]
        pieces = [s.piece(p.embeds.shape[0]) for s, p in zip(seqs, prompts)]
        rows = [InputRows(p.embeds[a:b], None if p.text_only else p.positions[:, a:b])
                for p, (a, b) in zip(prompts, pieces)]
        last, _ = self.long_prefill.run([(r, s.slot, a) for r, s, (a, _) in zip(rows, seqs, pieces)])
        ending = [i for i, (p, (_, b)) in enumerate(zip(prompts, pieces)) if b == p.embeds.shape[0]]
        pending = []
        for s, p, (_, b) in zip(seqs, prompts, pieces):
            if b < p.embeds.shape[0]:
                self.slots[s.slot] = _SlotState(b, 0, p.tts_eos, p.tts_pad)
                pending.append(StepResult(s, None))
        if ending:
            done = [seqs[i] for i in ending]
            results = results + self._prefilled(done, [self.long_prompts.pop(s.slot) for s in done], last[ending])
        return results, pending

    def _prefilled(self, seqs: list[Sequence], prompts: list[PromptRows], hidden: torch.Tensor) -> list[StepResult]:
        """The prompts are in their slots (hidden [n, D]: each one's last normed hidden state): codebook 0 of
        each one's frame 0 is picked, and its slot state set."""
        slots = to_device([s.slot for s in seqs], self.device)
        self.hidden[slots] = hidden
        picked = self._pick_c0(self.model.codec_head(hidden), seqs)
        self.c0[slots] = picked
        results = []
        for seq, p, token in zip(seqs, prompts, picked.tolist()):
            self.slots[seq.slot] = _SlotState(p.embeds.shape[0], p.rope_delta, p.tts_eos, p.tts_pad)
            results.append(self._accept(seq, token))
        return results

    def _complete_frames(self, seqs: list[Sequence]) -> torch.Tensor:
        """The code predictor completes each sequence's next frame from its codebook 0 (self.c0, on the
        device: no sync since the pick): returns the codes [n, 16]; their summed embeddings wait in
        codec_sums until the frame is read back."""
        slots = to_device([s.slot for s in seqs], self.device)
        if self.static_predictor is not None:
            codes, codec_sum = self.static_predictor(self.hidden[slots], self.c0[slots], [s.params.greedy for s in seqs])
            codes = codes.clone()  # leaves with the response; the next replay overwrites the static buffer
        else:
            pick = lambda step, logits: self._pick_residual(logits, seqs)
            codes, codec_sum = self.predictor(self.hidden[slots], self.c0[slots], pick)
        self.codec_sums[slots] = codec_sum
        return codes

    def _advance(self, seqs: list[Sequence], riders: list[Sequence] = (), prompts: list[PromptRows] = ()
                 ) -> torch.Tensor:  # fmt: skip
        """Reads each sequence's last frame back with its text row and picks the next frame's codebook 0;
        riders' prompts (_ride()) prefill in the same forward and pick their frame 0's. Returns the picks of
        seqs then riders, on the device, and keeps them in self.c0."""
        slots = to_device([s.slot for s in seqs], self.device)
        # rows of occupied slots that are not stepping (waiting for text) write at their next free position
        self.decoder.embeds[slots, 0] = self.codec_sums[slots] + self._text_inputs(seqs)
        for seq in seqs:
            self.cache.grow(seq.slot, self.slots[seq.slot].length + 1)
        states = self._step_states()
        step = ([st.length if st else 0 for st in states], [st.rope_delta if st else 0 for st in states])
        if riders:
            hidden, _ = self.long_prefill.run(_pieces(prompts, riders), beside=(self.decoder, step))
            self.prompts_in_decode += len(riders)
        else:
            self.decoder.step(*step)
        self.hidden[slots] = self.decoder.hidden_out[slots]
        logits = self.decoder.logits_out[slots]
        if riders:
            ridden = to_device([s.slot for s in riders], self.device)
            self.hidden[ridden] = hidden
            logits = torch.cat([logits, self.model.codec_head(hidden)])
            slots = torch.cat([slots, ridden])
        picked = self._pick_c0(logits, seqs + riders)
        self.c0[slots] = picked
        for seq in seqs:
            state = self.slots[seq.slot]
            state.length += 1
            state.unfed = False
        for seq, p in zip(riders, prompts):
            self.slots[seq.slot] = _SlotState(p.embeds.shape[0], p.rope_delta, p.tts_eos, p.tts_pad)
        return picked

    def _accept(self, seq: Sequence, token: int) -> StepResult:
        """The next frame's codebook 0 was picked: EOS ends the stream, anything else is kept for it."""
        if token == self.eos:
            return StepResult(seq, None, "stop")
        seq.generated.append(token)
        return StepResult(seq, None)

    def _text_inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """[n, D] rows fed with frame k (k = frames so far): reply row k (projected in one batch), then
        tts_eos once, then tts_pad."""
        out = torch.empty(len(seqs), self.text_config.hidden_size, dtype=self.dtype, device=self.device)
        speaking = []
        for i, seq in enumerate(seqs):
            state, text = self.slots[seq.slot], seq.payload.text
            if state.frames < len(text):
                speaking.append(i)
            else:
                out[i] = state.tts_eos if state.frames == len(text) else state.tts_pad
        if speaking:
            raw = torch.stack([seqs[i].payload.text[self.slots[seqs[i].slot].frames] for i in speaking])
            rows = self.model.text_projection(to_device(raw, self.device).to(self.dtype))
            out[to_device(speaking, self.device)] = rows  # (a list index would be a synchronous copy)
        return out

    def _pick_c0(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        banned = [[self.eos] if s.num_generated < s.params.min_tokens or s.params.ignore_eos else [] for s in seqs]
        for s in seqs:
            s.num_generated += 1
        return self.sampler.sample(
            logits, [s.request_id for s in seqs], [s.params for s in seqs], [s.generated for s in seqs], banned,
            suppress=self.suppress,
        )  # fmt: skip

    def _pick_residual(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # codebooks 1..15: greedy when the request is greedy, else top-k 50 / top-p 0.8 as the reference does
        rows = logits.argmax(-1)
        for i, s in enumerate(seqs):
            if not s.params.greedy:
                rows[i] = self.sampler.draw(logits[i], 1.0, 50, 0.8, self.sampler.generator(s.request_id, s.params))
        return rows


def _pieces(prompts: list[PromptRows], seqs: list[Sequence]) -> list[tuple[InputRows, int, int]]:
    """Whole prompts as the long prefill's pieces: their rows (with their MRoPE positions where they have
    media), their slots, starting at 0."""
    return [(InputRows(p.embeds, None if p.text_only else p.positions), s.slot, 0) for p, s in zip(prompts, seqs)]
