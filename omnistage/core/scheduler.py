# Iteration-level scheduler (torch-free): who gets a KV slot, who is prefilled this step, who decodes.
# A sequence holds one slot from admission to finish/abort; slots are the rows of the stage's static
# KV cache, handed out lowest-first so the active rows stay packed at the front (decode batches are
# rows [0, n) of the cache, no gather).
from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import BadRequestError, OverloadedError
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


@dataclass
class Batch:
    prefills: list[Sequence]
    decodes: list[Sequence]

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


# Prompts prefilled in one engine step. Closed-loop clients come back in cohorts: with 32 a cohort of 64 W1
# streams waits two prefill steps, not four (H200: 40.7 -> 46.0 req/s against 16,
# perf/results/2026-12-04-h200-variants-3.json).
MAX_PREFILLS_PER_STEP = 32
# Prompt tokens prefilled in one step (a longer prompt still goes alone): 32 prompts of 2500 tokens in one
# forward ran the H200 out of memory.
MAX_PREFILL_TOKENS = 16384


class Scheduler:
    """max_prefill_tokens: a step's prefills stop before their prompts pass this many tokens (the first is
    always taken, however long): the prompt count alone lets 32 long prompts into one forward, whose
    activations (80k tokens of W2 on the H200) ran the device out of memory and failed them all."""

    def __init__(self, max_slots: int, max_prefills_per_step: int = 8, max_waiting: int = 1024,
                 max_prefill_tokens: int | None = None):  # fmt: skip
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.max_slots = max_slots
        self.max_prefills_per_step = max_prefills_per_step
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self._free = list(range(max_slots))  # min-heap
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

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
                 prompt_tokens: Callable[[Sequence], int] | None = None) -> Batch:  # fmt: skip
        """prompt_tokens(seq): its prompt's length, for max_prefill_tokens (no budget without it)."""
        decodes = [s for s in self.running.values() if is_ready(s)]
        prefills = []
        budget = self.max_prefill_tokens if prompt_tokens is not None else None
        while self.waiting and self._free and len(prefills) < self.max_prefills_per_step:
            if budget is not None:
                tokens = prompt_tokens(self.waiting[0])
                if prefills and tokens > budget:
                    break
                budget -= tokens
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free)
            seq.status = SeqStatus.RUNNING
            self.running[seq.request_id] = seq
            prefills.append(seq)
        return Batch(prefills, decodes)

    def finish(self, seq: Sequence) -> None:
        """Frees the sequence's slot; used for normal completion, errors and aborts alike."""
        if seq.status is SeqStatus.RUNNING:
            del self.running[seq.request_id]
            heapq.heappush(self._free, seq.slot)
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
