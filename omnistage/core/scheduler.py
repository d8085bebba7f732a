# Iteration-level scheduler (torch-free): who gets a slot, which prompt tokens are prefilled this step, who
# decodes, and, with a paged KV cache (core/block_pool.py), who must give its blocks back. A sequence holds
# one slot (its batch row) from admission to finish/abort/preemption, handed out lowest-first so the active
# rows stay packed at the front (decode batches are rows [0, n) of the cache, no gather). A prompt longer
# than the runner prefills in one piece is prefilled in pieces over several steps (chunked prefill); until
# its last piece it holds its slot but is not decoded.
# Memory decides admission: a waiting sequence is admitted when its prompt's blocks and a reserve for its
# reply fit beside what the running sequences have reserved. A stage whose sequences can be recomputed (the
# thinker) reserves a little and, when a decode step needs more blocks than are free, preempts the newest
# running sequence: its blocks go back, and it waits at the head of the queue to be prefilled again from
# its prompt and the tokens it had generated. A stage whose sequences cannot be recomputed (the talker)
# reserves each sequence's whole reply, so its decode steps always find their blocks.
# A prompt that goes in pieces may start with a kept prefix (the runner's prefix cache): its slot takes those
# blocks by reference, its pieces start after them, and its admission counts only the blocks it adds.
from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .block_pool import BLOCK, BlockPool, blocks_for
from .errors import BadRequestError, OverloadedError
from .prefill_step import PrefillStep
from .sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    params: SamplingParams
    payload: Any  # stage-specific request data (prompt tensors...), opaque here
    slot: int = -1
    status: SeqStatus = SeqStatus.WAITING
    num_generated: int = 0
    state: Any = None  # runner-owned per-sequence state, created at prefill
    generated: list[int] = field(default_factory=list)  # token ids, for penalties and stop checks
    added_at: float = 0.0  # perf_counter() when the engine took it (StageEngine.add)
    answered: bool = False  # an output of it was emitted
    admitted: int = -1  # admission order (the newest running sequence is preempted first)
    reserved_blocks: int = 0  # blocks reserved at admission: prompt, first decode position, reply reserve
    preemptions: int = 0
    prompt_len: int = 0  # its prompt's tokens, when the runner counts them (0: prefilled in one piece)
    prefilled: int = 0  # prompt tokens in its slot once this step's prefill has run
    chunk: int = 0  # of those, the ones this step's prefill writes (0: none scheduled, the whole prompt)
    # pool blocks of the kept prompt prefix its slot starts with (a prompt in pieces, set at admission)
    prefix: list[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Prompt tokens its slot takes from a kept prefix, not prefilled."""
        return len(self.prefix) * BLOCK

    @property
    def first_piece(self) -> bool:
        """This step's piece starts its prompt (right after its kept prefix)."""
        return self.chunk == 0 or self.prefilled - self.chunk == self.cached

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is not in its slot yet: it holds its slot but does not decode."""
        return self.prefilled < self.prompt_len

    def piece(self, prompt_len: int) -> tuple[int, int]:
        """The positions [start, end) of its prompt that this step's prefill writes: the piece the scheduler
        gave it, or the whole prompt where no scheduler gave one (a runner driven directly)."""
        if self.chunk == 0:
            return 0, prompt_len
        return self.prefilled - self.chunk, self.prefilled


@dataclass
class Batch:
    prefills: list[Sequence]
    decodes: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)  # gave their blocks back: the runner drops them

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


# Prompts prefilled in one engine step. Closed-loop clients come back in cohorts: with 32 a cohort of 64 W1
# streams waits two prefill steps, not four (H200: 40.7 -> 46.0 req/s against 16,
# perf/results/h200-trace-variants.json).
MAX_PREFILLS_PER_STEP = 32
# Prompt tokens prefilled in one step: 32 prompts of 2500 tokens in one forward (80k tokens of W2) ran the
# H200 out of memory. Also what a step of prefill can hold the decode of every running stream back by.
MAX_PREFILL_TOKENS = 16384
# While other sequences decode, what the pieces of long prompts may attend in one step, as (new token,
# attended position) pairs: one 128-token piece (stages/long_prefill.py: PIECE_TOKENS) at 32k positions,
# or a W2 prompt (2,500 tokens) in two steps. The attention of a piece grows with its position: a 512-token chunk
# of a 30,000-token prompt is ~50 ms of the H200 in the thinker (with one such chunk a step, 64 W1 streams
# beside four such prompts ran at RTF 1.07, perf/README.md), and 16k tokens of such pieces a step make
# steps of seconds that stall every running stream's speech. Alone, long prompts take the whole token
# budget in whole chunks.
ATTENDED_BESIDE_DECODES = 4 << 20
# Reply positions reserved at admission for a sequence that can be recomputed: a W1 reply (18 tokens) and
# then some, so a full pool makes requests wait rather than preempt each other at once.
REPLY_RESERVE_TOKENS = 64


class Scheduler:
    """max_prefill_tokens: the prompt tokens one step prefills. A step's prefills, in this order:
    1. the oldest prompt part-way through its prefill goes on by a chunk, whatever the budget (every
       prompt ends);
    2. waiting prompts that prefill in one piece, oldest first, while they fit the budget (the first of the
       step is taken however long): a short prompt never waits for a long one's pieces;
    3. the prompts part-way through, then new long prompts, oldest first, each in whole chunks
       (chunk_tokens) of what the budget leaves (within attended_beside_decodes while others decode), and
       its prompt's last tokens.
    A waiting prompt is admitted when a slot is free and, with a block pool, its blocks fit; one that does
    not fit stops the admissions of the step (no newer prompt goes before it). Without the runner's prompt
    lengths (prompt_tokens) every admitted prompt prefills whole, bounded by max_prefills_per_step alone."""

    def __init__(self, max_slots: int, max_prefills_per_step: int = 8, max_waiting: int = 1024,
                 max_prefill_tokens: int | None = None, blocks: BlockPool | None = None,
                 reply_reserve: int | None = REPLY_RESERVE_TOKENS,
                 attended_beside_decodes: int | None = None, piece_tokens: int | None = None):  # fmt: skip
        """blocks: the paged KV cache's pool (None: slots alone decide); reply_reserve: reply positions
        reserved at admission, None: the whole reply (sequences that cannot be recomputed, never preempted);
        attended_beside_decodes: while other sequences decode, the most (new token, attended position)
        pairs a step's pieces of long prompts add up to, and piece_tokens the unit those pieces grow in
        (core/prefill_step.py; None: no bound, whole chunks)."""
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.max_slots = max_slots
        self.max_prefills_per_step = max_prefills_per_step
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.attended_beside_decodes, self.piece_tokens = attended_beside_decodes, piece_tokens
        self.blocks, self.reply_reserve = blocks, reply_reserve
        self._free = list(range(max_slots))  # min-heap
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._admitted = 0
        self.preemptions = 0
        # why the head of the queue waited at the last step: "slots", "blocks" or None (it did not)
        self.wait_reason: str | None = None
        self.waits = {"slots": 0, "blocks": 0}  # steps that left requests waiting, by reason
        self._spare = 0  # during schedule(): blocks still to be had for admissions
        self._preempting = False  # during schedule(): the step had to preempt

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or any(s.request_id == request_id for s in self.waiting)

    def get(self, request_id: str) -> Sequence | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((s for s in self.waiting if s.request_id == request_id), None)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self:
            raise BadRequestError(f"request id {seq.request_id!r} is already active")
        if len(self.waiting) >= self.max_waiting:
            raise OverloadedError(f"queue full ({self.max_waiting} waiting)")
        self.waiting.append(seq)

    def schedule(self, is_ready: Callable[[Sequence], bool] = lambda s: True,
                 prompt_tokens: Callable[[Sequence], int] | None = None,
                 kv_tokens: Callable[[Sequence], int] | None = None,
                 chunk_tokens: Callable[[Sequence], int] | None = None,
                 prefix_blocks: Callable[[Sequence], list[int]] | None = None) -> Batch:  # fmt: skip
        """prompt_tokens(seq): its prompt's length, for max_prefill_tokens and the blocks a prefill takes;
        kv_tokens(seq): positions a running sequence's cache holds after its next decode step (both needed
        with a block pool); chunk_tokens(seq): the most of its prompt the runner prefills in one piece
        (without it: all of it); prefix_blocks(seq): the pool blocks of the kept prefix a waiting prompt that
        goes in pieces would start with now (Sequence.prefix). Sets each prefilled sequence's piece
        (Sequence.chunk, .prefilled)."""
        decodes = [s for s in self.running.values() if not s.prefilling and is_ready(s)]
        preempted = self._make_room(decodes, kv_tokens) if self.blocks is not None else []
        self._spare = self._spare_blocks() if self.blocks is not None and self.waiting else 0
        self._preempting = bool(preempted)
        self.wait_reason = None
        step = PrefillStep(self.max_prefill_tokens if prompt_tokens is not None else None, self.max_prefills_per_step,
                           chunk_tokens or (lambda s: s.prompt_len),
                           self.attended_beside_decodes if decodes else None, self.piece_tokens)  # fmt: skip
        partial = [s for s in self.running.values() if s.prefilling]  # admission order: oldest first
        if partial:
            step.take(partial[0], first=True)
        blocked = False  # a waiting prompt waits for the next step: no newer one goes before it
        for seq in list(self.waiting):
            if step.full:
                break
            seq.prompt_len = prompt_tokens(seq) if prompt_tokens is not None else 0
            if step.one_piece(seq):
                if not step.fits(seq.prompt_len) or not self._fits(seq, seq.prompt_len):
                    blocked = True
                    break
                self.waiting.remove(seq)
                step.take(self._admit(seq, seq.prompt_len))
        for seq in partial:
            step.take(seq)
        for seq in [] if blocked else list(self.waiting):
            if step.full or step.budget < 1:
                break
            seq.prefix = prefix_blocks(seq) if prefix_blocks is not None else []
            seq.prefilled = seq.cached  # its pieces start after the prefix
            if not self._fits(seq, seq.prompt_len):
                break
            if step.take(seq, admit=lambda s: self._admit(s, s.prompt_len)):
                self.waiting.remove(seq)
        if self.wait_reason is not None:
            self.waits[self.wait_reason] += 1
        return Batch(step.prefills, decodes, preempted)

    def _fits(self, seq: Sequence, prompt: int) -> bool:
        """Whether a waiting sequence of `prompt` tokens can be admitted now: a free slot and, with a block
        pool, its blocks beside what the running ones reserved (none in a step that had to preempt). Sets
        wait_reason when not."""
        if not self._free:
            self.wait_reason = "slots"
            return False
        if self.blocks is not None and (self._preempting or self._taken_blocks(seq, prompt) > self._spare):
            self.wait_reason = "blocks"
            return False
        return True

    def _admit(self, seq: Sequence, prompt: int) -> Sequence:
        if self.blocks is not None:
            seq.reserved_blocks = self._reserved_blocks(seq, prompt)
            self._spare -= self._taken_blocks(seq, prompt)
        seq.slot = heapq.heappop(self._free)
        seq.status = SeqStatus.RUNNING
        seq.admitted, self._admitted = self._admitted, self._admitted + 1
        self.running[seq.request_id] = seq
        return seq

    # ---- blocks -------------------------------------------------------------------------------------------
    def _reserved_blocks(self, seq: Sequence, prompt: int) -> int:
        """Blocks a sequence of `prompt` positions reserves: its prompt, the position its first decode step
        writes, and its reply reserve."""
        reply = seq.params.max_tokens if self.reply_reserve is None else min(seq.params.max_tokens, self.reply_reserve)
        return blocks_for(prompt + 1 + reply)

    def _taken_blocks(self, seq: Sequence, prompt: int) -> int:
        """Spare blocks admitting seq takes: its reserve less the kept prefix it shares, and those blocks of
        the prefix that only the prefix cache holds (spare while they could be reclaimed, not once seq holds
        them too)."""
        alone = sum(1 for b in seq.prefix if self.blocks.refs[b] == 1)
        return self._reserved_blocks(seq, prompt) - len(seq.prefix) + alone

    def _spare_blocks(self) -> int:
        """Blocks to be had (free, or kept by a prefix cache alone) beyond what the running sequences have
        reserved and not taken yet."""
        outstanding = sum(max(0, s.reserved_blocks - self.blocks.held(s.slot)) for s in self.running.values())
        return self.blocks.available_blocks - outstanding

    def _make_room(self, decodes: list[Sequence], kv_tokens) -> list[Sequence]:
        """Preempts the newest running sequences until this step's decodes find their blocks; returns them."""
        preempted = []
        need = {id(s): self.blocks.needed(s.slot, kv_tokens(s)) for s in decodes}
        # (free blocks first: counting what a prefix cache could give back walks its blocks)
        while self.reply_reserve is not None and sum(need.values()) > self.blocks.free_blocks \
                and sum(need.values()) > self.blocks.available_blocks:  # fmt: skip
            victim = max(self.running.values(), key=lambda s: s.admitted)
            if len(self.running) == 1:
                break  # alone, it has the whole pool: the runner fails it if even that is too little
            self._preempt(victim)
            preempted.append(victim)
            if need.pop(id(victim), None) is not None:
                decodes.remove(victim)
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.prefilled = seq.chunk = 0  # prefilled again from its start
        seq.prefix = []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """A running sequence leaves the running set: its slot and (with a pool) its blocks go back."""
        del self.running[seq.request_id]
        heapq.heappush(self._free, seq.slot)
        if self.blocks is not None:
            self.blocks.release(seq.slot)

    def finish(self, seq: Sequence) -> None:
        """Frees the sequence's slot and blocks; used for normal completion, errors and aborts alike."""
        if seq.status is SeqStatus.RUNNING:
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def slots_in_use(self) -> int:
        return self.max_slots - len(self._free)

    @property
    def active_rows(self) -> int:
        """Rows [0, n) of the cache that hold every running sequence."""
        return 1 + max((s.slot for s in self.running.values()), default=-1)
