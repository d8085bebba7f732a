# ThinkerRunner: owns the thinker's weights, its paged KV cache and per-slot decode state. Prefill batches
# the step's prompts by kind (thinker_prefill.py), writing their K/V into their slots' blocks; decode batches
# every running request. A sequence preempted for memory (core/scheduler.py) comes back as a prompt of its
# original prompt and the tokens it had generated, and goes on from there.
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..core.engine import StepResult
from ..core.errors import BadRequestError
from ..core.scheduler import Sequence
from .chunk_prefill import ChunkPrefill
from .conditioning import TalkerConditioning, user_positions
from .host_copy import outputs_to_host, to_device, to_host
from .media_prefill import MediaPrefill
from .media_prefix_cache import MediaPrefixCache
from .media_rows import MediaInputs
from .prefix_cache import PrefixCache
from .runner import WARM_UP_STEPS, DecoderRunner
from .thinker_prefill import JOINT_ROWS, ThinkerPrefill
from .warm_up import warm_up_turns


@dataclass
class ThinkerPrompt:
    input_ids: torch.Tensor  # [L] long
    pixel_values: torch.Tensor | None = None  # [patches, C*T*P*P] uint8 (models/pixels.py)
    image_grid_thw: torch.Tensor | None = None
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    export_talker: bool = False  # also produce what the talker needs
    pixel_values_videos: torch.Tensor | None = None  # [patches, C*T*P*P] uint8
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None  # [videos] seconds of video per temporal grid step
    use_audio_in_video: bool = False  # the videos' audio tracks are interleaved with their frames
    # a preempted sequence's prompt when it comes back: the original prompt's length (input_ids then go on
    # with the tokens it had generated, recomputed in its prefill); 0: a first prefill
    resumed_from: int = 0
    # derived from the media at admission (ThinkerRunner.validate, on the caller's thread), so that the
    # engine's steps do not hash a picture's patches or derive its positions while others wait
    salts: dict[int, bytes] | None = None  # the media's content digests by block (MediaPrefixCache.salts)
    rope: tuple[torch.Tensor, int] | None = None  # MRoPE positions [3, L] and rope delta (MediaInputs.rope_index)

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


class ThinkerRunner(ThinkerPrefill, DecoderRunner):
    STAGE = "thinker"
    RECOMPUTES = True  # a preempted sequence can be recomputed from its prompt and generated tokens

    def __init__(self, model, config, *, max_slots: int, max_seq_len: int, device, dtype, seed: int = 0,
                 cuda_graphs: bool = False, max_prefills: int = 16, prefix_cache_bytes: int = 0,
                 kv_cache_bytes: int | None = None, pixel_table: torch.Tensor | None = None):  # fmt: skip
        accept_layer = config.talker_config.accept_hidden_layer
        deepstack = len(config.thinker_config.vision_config.deepstack_visual_indexes)
        super().__init__(model, config, config.thinker_config.text_config, max_slots=max_slots,
                         max_seq_len=max_seq_len, device=device, dtype=dtype, seed=seed, cuda_graphs=cuda_graphs,
                         max_prefills=max_prefills, head=model.lm_head, embed=model.get_input_embeddings(),
                         kv_cache_bytes=kv_cache_bytes, deepstack=deepstack, accept_layer=accept_layer)  # fmt: skip
        self.media = MediaInputs(model, pixel_table)  # the media encoders, over all media of a step at once
        # prompts with media rows prefill batched, with the step's other fresh prompts
        self.media_prefill = MediaPrefill(self.STAGE, model.model, self.cache, max_rows=self.static_prefill.max_rows,
                                          max_tokens=self.static_prefill.max_tokens, deepstack=deepstack,
                                          accept_layer=accept_layer, cuda_graphs=cuda_graphs)  # fmt: skip
        self.long_media: dict = {}  # slot -> its media prompt's rows, while prefilled in pieces (LongMedia)
        self.pieces_in_decode = 0  # long prompts' pieces run in a decode step's forward (decode()'s riders)
        self.prompts_in_decode = 0  # whole prompts prefilled in a decode step's forward (the same)
        # text-only prompts that start like earlier ones take the kept prefix's K/V and prefill only the rest
        self.prefix = PrefixCache(self.cache, prefix_cache_bytes) if prefix_cache_bytes else None
        self.chunk_prefill = (ChunkPrefill("thinker", model.model, self.cache, max_rows=min(max_prefills, max_slots),
                                           cuda_graphs=cuda_graphs) if self.prefix else None)  # fmt: skip
        # kept prefixes of prompts with media, keyed by the media's content (media_prefix_cache.py)
        self.media_prefix = MediaPrefixCache(self)
        self.eos_ids = {config.im_end_token_id, 151643}  # <|im_end|>, <|endoftext|>
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

    def validate(self, seq: Sequence) -> None:
        length = self.prompt_tokens(seq)
        if length == 0:
            raise BadRequestError("empty prompt")
        seq.params = seq.params.fit_to_context(length, self.context)
        p = seq.payload
        if not p.is_text_only:
            self.media.validate(p)
            if self.prefix is not None:
                p.salts = self.media_prefix.salts(p, p.input_ids.cpu())
            p.rope = self.media.rope_index(p)

    def _prompt_ids(self, seq: Sequence) -> torch.Tensor:
        """The token ids its prefill runs over, on the host: a preempted sequence's go on with the tokens it
        had generated."""
        p = seq.payload
        if not seq.num_generated:
            return p.input_ids.cpu()
        original = p.resumed_from or int(p.input_ids.numel())
        return torch.cat([p.input_ids[:original].cpu(), torch.tensor(seq.generated, dtype=p.input_ids.dtype)])

    def _warm_up_batches(self) -> list[list[ThinkerPrompt]]:
        """A text turn alone (StaticPrefill), then an audio, an image and a video turn together (MediaPrefill
        and both encoders), each feeding a talker (its conditioning is built too); those longer than the slots
        or the media buffers are left out."""
        turns = [ThinkerPrompt(torch.tensor(t.ids), t.pixel_values, t.image_grid_thw, t.input_features,
                               t.feature_attention_mask, export_talker=True, pixel_values_videos=t.pixel_values_videos,
                               video_grid_thw=t.video_grid_thw, video_second_per_grid=t.video_second_per_grid)
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
        self.long_prefill.capture_beside(self.decoder)  # the pieces that ride decode steps (riders())
        if self.chunk_prefill is not None:
            self.chunk_prefill.capture_all()
            self.chunk_prefill.joint.pool = self.static_prefill.bank.pool  # the prompts that ride them
            self.chunk_prefill.capture_beside(self.decoder, tuple(self.chunk_prefill.token_buckets), JOINT_ROWS)

    def stats(self) -> dict:
        p = self.prefix
        return {"prefix_hit_tokens": p.hit_tokens if p else 0, "prefix_prompt_tokens": p.prompt_tokens if p else 0,
                "pieces_in_decode": self.pieces_in_decode, "prompts_in_decode": self.prompts_in_decode}

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], riders: list[Sequence] = ()) -> list[StepResult]:
        """One decode step of seqs; riders (riders()): this step's long prompts' pieces, its text prompts that
        take a kept prefix, or its media prompts, run in the same forward where the captured shapes
        allow, answered as prefill() answers them."""
        # every occupied slot up to the highest takes part (a just-prefilled one too), see StaticDecoder.step
        for seq in seqs:
            self.cache.grow(seq.slot, self.slots[seq.slot].length + 1)
        if riders and not self._in_chunks(riders[0]) and riders[0].payload.is_text_only:
            return self._decode_beside_prompts(seqs, riders)
        media = bool(riders) and not self._in_chunks(riders[0])  # media prompts, a long piece each
        if riders:
            self._start(riders)
            pieces, spans = self._media_pieces(riders) if media else self._long_pieces(riders)
        rows = self._decode_rows()
        if not riders:
            self.decoder.step(*rows)
            return self._decoded(seqs)
        if self.long_prefill.joins(pieces, self._decode_shape(rows)):
            last, accepted = self.long_prefill.run(pieces, beside=(self.decoder, rows))
            if media:
                self.prompts_in_decode += len(riders)
            else:
                self.pieces_in_decode += len(pieces)
        else:  # no graph for this shape beside a decode step: one forward each
            last, accepted = self.long_prefill.run(pieces)
            self.decoder.step(*rows)
        results = self._decoded(seqs)
        ridden = self._long_results(riders, spans, last, accepted)
        outputs_to_host([r.output for r in ridden if r.output is not None], self.device)
        return results + ridden

    def _decode_beside_prompts(self, seqs: list[Sequence], prompts: list[Sequence]) -> list[StepResult]:
        """A decode step with the step's prompts that take a kept prefix: their suffixes in the decode's
        forward where a captured shape takes them beside it, else prefilled first in a forward of their own.
        Their slots write the decode's unused rows past their prompts, where their first decode writes."""
        self._start(prompts)
        found = self._suffix_hits(prompts)
        for s in prompts:
            self._pending(s, self.prompt_tokens(s))
        rows = self._decode_rows()
        if len(found) == len(prompts) and self._suffixes_fit(prompts, found, self._decode_shape(rows)):
            found = self._suffix_hits(prompts, take=True)  # the same prefixes: nothing ran since the look
            ridden = self._prefill_after_prefix(prompts, found, beside=(self.decoder, rows))
            for seq in prompts:  # as prefill() keeps them
                self.prefix.store(seq.slot, found[id(seq)])
            self.prompts_in_decode += len(prompts)
            outputs_to_host([r.output for r in ridden if r.output is not None], self.device)
            return self._decoded(seqs) + ridden
        ridden = self.prefill(prompts)
        self.decoder.step(*self._decode_rows())
        return self._decoded(seqs) + ridden

    def _decode_rows(self) -> tuple[list[int], list[int], list[int]]:
        """A decode step's (positions, rope deltas, last tokens) over every slot up to the highest occupied."""
        states = self._step_states()
        return ([s.length if s else 0 for s in states], [s.rope_delta if s else 0 for s in states],
                [s.last_token if s else 0 for s in states])  # fmt: skip

    def _decode_shape(self, rows: tuple[list[int], list[int], list[int]]) -> tuple[int, int]:
        positions = rows[0]
        return self.decoder.shape_for(len(positions), max(positions) + 1)

    def _decoded(self, seqs: list[Sequence]) -> list[StepResult]:
        """The decode step's results: each sequence's token picked from the step's logits."""
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
    def _pending(self, seq: Sequence, length: int) -> None:
        """The slot of a prompt part-way through its pieces: a stand-in state whose length is the last
        piece's end, where decode steps meanwhile write their unused row and the next piece writes first."""
        self.slots[seq.slot] = _SlotState(length, 0, 0)

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
        """What generate() hands the talker, for one prompt: the user turns' ids and, on their audio/image/video
        rows, the accept-layer hidden states (the talker looks the text rows up in the thinker's embedding
        table itself, so a long prompt's conditioning is its media rows, not every row); the assistant header
        rows, the tts rows, and any prompt rows after the assistant header (spoken before the reply).
        `ids` are the prompt's token ids on the host: which rows go where is decided there, and the device
        only gathers. Each host sync here (a boolean mask, nonzero) would wait for a turn on a GPU that
        the other stage processes share, once per prompt."""
        c = self.config  # embeds: layer-0 input embeddings [L, D]; hidden: the accept layer's hidden states
        ids = ids.cpu()
        user = user_positions(ids, c.im_start_token_id, c.user_token_id)
        is_mm = torch.isin(ids, self.mm_ids)
        header = ((ids[:-1] == c.im_start_token_id) & (ids[1:] == c.assistant_token_id)).nonzero()
        if header.numel() == 0:
            raise BadRequestError("prompt has no assistant header (<|im_start|>assistant) for the talker")
        a = int(header[-1])
        user_is_mm = is_mm[user]
        media = user[user_is_mm]
        tts = self.model.get_input_embeddings()(self.tts_ids)
        cond = TalkerConditioning(
            media_rows=hidden.index_select(0, to_device(media, self.device)).float(),
            user_is_mm=user_is_mm,
            user_ids=ids[user],
            special_rows=torch.cat([embeds[a : a + 3], tts]).float(),
        )
        return cond, embeds[a + 3 :].float()
