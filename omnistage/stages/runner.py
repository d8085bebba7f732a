# DecoderRunner: what the thinker and talker runners share. Each owns a transformers decoder stack on its
# device, a paged KV cache of max_slots slots (rows) over one pool of blocks with one state per occupied
# slot, a sampler, and the two
# static paths that replay as CUDA graphs on cuda (one decode step over every occupied slot, and the
# prefill of text-only prompts); off cuda the same code runs eagerly. A runner adds its stage's prompts,
# outputs and step logic (prefill, decode) on top.
from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.sampling import SamplingParams
from ..models import fused
from ..core.scheduler import Sequence, SeqStatus
from .kv_budget import plan_pool
from .long_prefill import CHUNK_TOKENS, LongPrefill
from .paged_kv import PagedKVCache
from .sampler import Sampler
from .static_decode import StaticDecoder
from .static_prefill import StaticPrefill

# Text-only prompts of up to this many tokens prefill whole from static buffers (W1's are ~150 thinker
# tokens, ~160 talker rows); longer ones in chunks (stages/long_prefill.py).
STATIC_PREFILL_TOKENS = CHUNK_TOKENS
# Decode steps of the synthetic request a runner serves while it loads (warm_up).
WARM_UP_STEPS = 3


class DecoderRunner:
    STAGE = ""  # thinker | talker: names the CUDA graph banks

    def __init__(self, model, config, text_config, *, max_slots: int, max_seq_len: int, device, dtype, seed: int,
                 cuda_graphs: bool, max_prefills: int, head: Callable[[torch.Tensor], torch.Tensor],
                 embed: Callable[[torch.Tensor], torch.Tensor] | None, kv_cache_bytes: int | None = None,
                 deepstack: int = 0, accept_layer: int | None = None):  # fmt: skip
        """head: [rows, D] -> [rows, vocab] logits; embed: token ids -> input rows, None where the stage
        feeds input embeddings itself (the talker); max_seq_len: positions per sequence (its context);
        kv_cache_bytes: the pool's budget (stages/kv_budget.py); deepstack / accept_layer: what long
        prompts' media rows touch in the layers (layer_spans.py), the thinker's."""
        self.model, self.config, self.device, self.dtype = model, config, torch.device(device), dtype
        # on CUDA the fused kernels are the measured path (perf/results/h200-static-prefill.json),
        # and the paged prefill attention runs only through the fused attention: a runner installs them
        # itself, so that no CUDA runner reads a long prompt's K/V without its causal limit
        self.fused = fused.install(model) if self.device.type == "cuda" else {}
        self.text_config = text_config
        self.max_seq_len = max_seq_len
        t = text_config
        # a request's prompt + reply: the checkpoint's context, or the profile's cap (max_seq_len) below it
        self.context = min(max_seq_len, t.max_position_embeddings)
        # with graphs a block table spans a chunk past the context, so that a long prompt's row padded to its
        # bucket ends inside it wherever the row starts (stages/long_prefill.py)
        table_len = (-(-self.context // CHUNK_TOKENS) + 1) * CHUNK_TOKENS if cuda_graphs else self.context
        self.kv_plan = plan_pool(t, dtype, max_slots, self.context, kv_cache_bytes)
        self.cache = PagedKVCache(t.num_hidden_layers, max_slots, t.num_key_value_heads, t.head_dim,
                                  num_blocks=self.kv_plan.blocks, max_len=table_len, dtype=dtype, device=self.device)  # fmt: skip
        self.slots: list = [None] * max_slots  # each occupied slot's state (the runner's own dataclass)
        self.sampler = Sampler(self.device, seed)
        self.decoder = StaticDecoder(self.STAGE, model.model, self.cache, head, t.vocab_size, embed,
                                     cuda_graphs=cuda_graphs)  # fmt: skip
        self.static_prefill = StaticPrefill(self.STAGE, model.model, self.cache, max_rows=min(max_prefills, max_slots),
                                            max_tokens=STATIC_PREFILL_TOKENS, cuda_graphs=cuda_graphs)  # fmt: skip
        self.long_prefill = LongPrefill(self.STAGE, model.model, self.cache, max_rows=min(max_prefills, max_slots),
                                        cuda_graphs=cuda_graphs, deepstack=deepstack, accept_layer=accept_layer)  # fmt: skip

    # ---- engine hooks -------------------------------------------------------------------------------------
    def is_ready(self, seq: Sequence) -> bool:
        return True

    def chunk_tokens(self, seq: Sequence) -> int:
        """The most of seq's prompt one prefill piece holds: a prompt too long for the static prefill goes in
        chunks (long_prefill.py), any other prompt whole."""
        return CHUNK_TOKENS if self._in_chunks(seq) else self.prompt_tokens(seq)

    def prompt_tokens(self, seq: Sequence) -> int:
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        self.preempt(seq)
        self.sampler.release(seq.request_id)

    def preempt(self, seq: Sequence) -> None:
        """Drops the sequence's slot state and blocks, keeping what its recompute needs (its sampler)."""
        if 0 <= seq.slot < len(self.slots):
            self.slots[seq.slot] = None
            self.cache.release(seq.slot)

    def kv_tokens(self, seq: Sequence) -> int:
        """Positions the sequence's cache holds once its next decode step has run."""
        state = self.slots[seq.slot] if 0 <= seq.slot < len(self.slots) else None
        return state.length + 1 if state is not None else 0

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Captures every graph bucket before serving (capture needs the device to itself)."""
        self.decoder.capture_all()
        self.static_prefill.capture_all()
        # one prefill replays at a time, and each leaves its results outside the pool: they can share it
        self.long_prefill.capture_all(self.static_prefill.bank.pool)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Serves the stage's synthetic requests (_warm_up_batches: each batch prefilled in one step, then
        decoded for WARM_UP_STEPS steps) in slots 0.. and frees them, before the stage reports ready: what the
        graph captures leave out (prompt projections, the media encoders, sampling, the host copies of
        outputs) loads and picks its kernels now, not on the first request served. Leaves no trace: the slots
        and the requests' samplers are freed, and their prompts are kept nowhere."""
        for batch in self._warm_up_batches():
            for first in range(0, len(batch), len(self.slots)):
                self._warm_up_step(batch[first : first + len(self.slots)])

    def _warm_up_step(self, payloads: list) -> None:
        params = SamplingParams(max_tokens=WARM_UP_STEPS + 1, ignore_eos=True)
        seqs = [Sequence(f"warm-up-{i}", params, p, slot=i) for i, p in enumerate(payloads)]
        for seq in seqs:
            seq.status = SeqStatus.RUNNING
        try:
            results = self.prefill(seqs)
            while live := [r.seq for r in results if r.finish_reason is None and self.is_ready(r.seq)]:
                results = self.decode(live)
        finally:
            for seq in seqs:
                self.release(seq)

    def _warm_up_batches(self) -> list[list]:
        """The synthetic requests' prompts (the stage's payload type), by prefill step."""
        raise NotImplementedError

    # ---- shared internals ---------------------------------------------------------------------------------
    def _in_chunks(self, seq: Sequence) -> bool:
        return self.prompt_tokens(seq) > self.static_prefill.max_tokens

    def _step_states(self) -> list:
        """The slot states a decode step covers: every slot up to the highest occupied one (None: free)."""
        return self.slots[: 1 + max(i for i, s in enumerate(self.slots) if s is not None)]
