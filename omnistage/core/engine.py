# The stage engine loop (torch-free): one thread owns the scheduler and the runner, so neither needs
# locks. Other threads talk to it only through `add` / `add_async` / `abort` / `update` (queued into an
# inbox) and hear back through `emit`, which is called on the engine thread and must not block (the Triton
# glue puts outputs on a queue drained by its own response thread, since response_sender.send() blocks).
from __future__ import annotations

import logging
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .errors import EngineError, OmniError
from .scheduler import Scheduler, SeqStatus, Sequence

log = logging.getLogger(__name__)

ABORTED = "abort"
SLOW_STEP_SECONDS = 2.0  # steps slower than this are logged
# Prompts validated at once by add_async(): one prompt's media digests (hashlib lets go of the GIL) run beside
# another's; a burst of 64 W4 prompts waits 94 ms on average for its admission on two cores, 154 ms in turn
# (perf/media_intake_timing.py)
INTAKE_THREADS = 4


@dataclass
class StepResult:
    seq: Sequence
    output: Any  # stage-specific output of this step (None: nothing to send)
    finish_reason: str | None = None  # set when the sequence is done


class StageRunner(Protocol):
    # raises BadRequestError; runs on the caller's thread, or on an intake thread (add_async): thread-safe
    def validate(self, seq: Sequence) -> None: ...
    def is_ready(self, seq: Sequence) -> bool: ...  # can this running sequence take a decode step now?
    def prefill(self, seqs: list[Sequence]) -> list[StepResult]: ...
    def decode(self, seqs: list[Sequence]) -> list[StepResult]: ...
    def release(self, seq: Sequence) -> None: ...  # drop per-sequence device state
    # optional: prompt_tokens(seq) -> int, its prompt's length, for the scheduler's max_prefill_tokens; with
    # a block pool also kv_tokens(seq) -> int (positions after its next decode step) and preempt(seq) (drop
    # its slot's state and blocks, keeping what a recompute needs); chunk_tokens(seq) -> int, the most of its
    # prompt one prefill piece holds (a longer prompt is prefilled over several steps: prefill() then gets
    # seqs whose piece, Sequence.piece(), is part of the prompt, and answers a piece that does not end the
    # prompt with a StepResult without output); prefix_blocks(seq) -> list[int], the pool blocks of a kept
    # prefix such a prompt's slot starts with (its pieces then start after it); riders(prefills) -> the
    # prefills of a step with decodes that decode(seqs, riders) runs instead of prefill() (in its forward)


# emit(request_id, output, finish_reason, error): finish_reason or error set means the stream ends
Emit = Callable[[str, Any, "str | None", "OmniError | None"], None]


class StageEngine:
    """Each phase's outputs leave as soon as the phase ends: a request's first output (the next stage's start)
    does not wait for the decode phase of the step that prefilled it."""

    def __init__(self, name: str, runner: StageRunner, scheduler: Scheduler, emit: Emit):
        self.name = name
        self.runner = runner
        self.scheduler = scheduler
        self.emit = emit
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._intake: ThreadPoolExecutor | None = None  # add_async()'s validations, started with the first one
        self._validating: dict[str, bool] = {}  # request id -> aborted while add_async() validates it (under _cv)
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_batch_size = 0
        self.last_step_seconds = 0.0
        # wall seconds spent in each phase: with the step's host sync, the stage's share of the device
        self.phase_seconds = {"prefill": 0.0, "decode": 0.0}
        self.decoded_rows = 0  # sequences over all decode steps (/ decode steps = mean decode batch)
        # a sequence's way to its first output: waiting for its prefill (seconds from add() to the start of
        # the prefill phase that took it), then up to its first output emitted (seconds from add())
        self.prefilled_rows = 0
        self.queue_seconds = 0.0
        self.first_outputs = 0
        self.first_output_seconds = 0.0

    # ---- called from other threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._intake is not None:  # validations still running end their sequences ("engine stopped")
            self._intake.shutdown(wait=False)

    def add(self, seq: Sequence) -> None:
        self.runner.validate(seq)  # bad input fails here, before anything is queued
        seq.added_at = time.perf_counter()
        self._post("add", seq)

    def add_async(self, seq: Sequence, refused: Callable[[Exception], None]) -> None:
        """add() with the validation on a thread of the engine's intake, for prompts whose validation is
        long (the thinker's media digests), so that the caller's thread takes the next request in meanwhile.
        refused(error) is called on that thread when the validation fails; an abort that comes while it
        runs ends the sequence (emit ABORTED) instead of queueing it."""
        with self._cv:
            self._validating[seq.request_id] = False
            if self._intake is None:
                self._intake = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix=f"{self.name}-intake")
        self._intake.submit(self._validate_and_add, seq, refused)

    def _validate_and_add(self, seq: Sequence, refused: Callable[[Exception], None]) -> None:
        try:
            self.runner.validate(seq)
        except Exception as e:
            with self._cv:
                self._validating.pop(seq.request_id, None)
            refused(e)
            return
        # queued under the lock (_cv's RLock): an abort that misses it in _validating comes after it in the inbox
        with self._cv:
            aborted, stopped = self._validating.pop(seq.request_id, False), self._stop
            if not (aborted or stopped):
                seq.added_at = time.perf_counter()
                self._post("add", seq)
        if aborted:
            self.emit(seq.request_id, None, ABORTED, None)
        elif stopped:
            self.emit(seq.request_id, None, None, EngineError(f"[{self.name}] engine stopped"))

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._validating:  # add_async() has not queued it yet: it ends it instead
                self._validating[request_id] = True
                return
        self._post("abort", request_id)

    def update(self, request_id: str, fn: Callable[[Sequence], None]) -> None:
        """Runs fn(seq) on the engine thread (e.g. append talker text); ignored if the request is gone."""
        self._post("update", (request_id, fn))

    def stats(self) -> dict:
        s = self.scheduler
        blocks = s.blocks
        return {
            "slots_in_use": s.slots_in_use,
            "running": len(s.running),
            "waiting": len(s.waiting),
            # why requests wait: for a slot (rows) or for KV blocks (memory); steps that left some waiting
            "waiting_for_slots": len(s.waiting) if s.wait_reason == "slots" else 0,
            "waiting_for_blocks": len(s.waiting) if s.wait_reason == "blocks" else 0,
            "steps_waiting_for_slots": s.waits["slots"],
            "steps_waiting_for_blocks": s.waits["blocks"],
            "preemptions": s.preemptions,
            "kv_blocks_used": blocks.used_blocks if blocks else 0,
            "kv_blocks_total": blocks.num_blocks - 1 if blocks else 0,
            "steps": self.steps,
            "last_batch_size": self.last_batch_size,
            "last_step_ms": round(self.last_step_seconds * 1e3, 3),
            "prefill_seconds": self.phase_seconds["prefill"],
            "decode_seconds": self.phase_seconds["decode"],
            "decoded_rows": self.decoded_rows,
            "prefilled_rows": self.prefilled_rows,
            "queue_seconds": self.queue_seconds,
            "first_outputs": self.first_outputs,
            "first_output_seconds": self.first_output_seconds,
            **(self.runner.stats() if hasattr(self.runner, "stats") else {}),
        }

    def _post(self, kind: str, item: Any) -> None:
        with self._cv:
            self._inbox.append((kind, item))
            self._cv.notify()

    # ---- engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        idle = False
        while True:
            with self._cv:
                if idle and not self._inbox and not self._stop:
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                self._apply(kind, item)
            batch = self.scheduler.schedule(self.runner.is_ready, getattr(self.runner, "prompt_tokens", None),
                                            getattr(self.runner, "kv_tokens", None),
                                            getattr(self.runner, "chunk_tokens", None),
                                            getattr(self.runner, "prefix_blocks", None))  # fmt: skip
            for seq in batch.preempted:  # back in the queue, recomputed when it is admitted again
                log.info("[%s] %s preempted for KV blocks", self.name, seq.request_id)
                self.runner.preempt(seq)
                seq.slot = -1
            idle = not batch and not batch.preempted
            if batch:
                self._step(batch.prefills, batch.decodes)
        for seq in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
            self._end(seq, None, EngineError(f"[{self.name}] engine stopped"))

    def _apply(self, kind: str, item: Any) -> None:
        if kind == "add":
            try:
                self.scheduler.add(item)
            except OmniError as e:
                self.emit(item.request_id, None, None, e)
        elif kind == "abort":
            seq = self.scheduler.get(item)
            if seq is not None:
                self._end(seq, None, None, ABORTED)
        elif kind == "update":
            request_id, fn = item
            seq = self.scheduler.get(request_id)
            if seq is not None:
                fn(seq)

    def _step(self, prefills: list[Sequence], decodes: list[Sequence]) -> None:
        t0 = time.perf_counter()
        first = [s for s in prefills if s.first_piece]  # their prompt's first piece (or all of it)
        self.prefilled_rows += len(first)
        self.queue_seconds += sum(t0 - s.added_at for s in first)
        # prefills that go through the decode step's forward (the runner's riders)
        riders_of = getattr(self.runner, "riders", None)
        riders = riders_of(prefills) if decodes and riders_of else []
        prefills = [s for s in prefills if s not in riders] if riders else prefills
        if prefills:
            self._run_phase("prefill", prefills)
            # What this step prefilled decodes in it too, when ready: a decode step runs every occupied row of
            # the static cache anyway (StaticDecoder), and the second output then leaves with the first,
            # a step earlier (the talker's second frame waits for the thinker's second token).
            # (a prompt part-way through its prefill does not decode: its slot holds only part of it)
            done = [s for s in prefills if s.status is SeqStatus.RUNNING and not s.prefilling]
            decodes = decodes + [s for s in done if self.runner.is_ready(s)]
        if decodes:
            self._run_phase("decode", decodes, riders)
        self.steps += 1
        self.last_batch_size = len({id(s) for s in prefills + decodes + riders})
        self.last_step_seconds = time.perf_counter() - t0
        if self.steps <= 3 or self.last_step_seconds > SLOW_STEP_SECONDS:
            log.info("[%s] step %d: %d prefill + %d decode in %.1f ms", self.name, self.steps, len(prefills),
                     len(decodes), self.last_step_seconds * 1e3)  # fmt: skip

    def _run_phase(self, phase: str, seqs: list[Sequence], riders: list[Sequence] = ()) -> None:
        """Runs a phase and hands its results on; riders: prefills run in the decode's forward."""
        t_phase = time.perf_counter()
        failed: list[tuple[Sequence, Exception]] = []  # a failed step fails its sequences, not the engine
        retry = phase == "prefill" and len(seqs) > 1
        before = [(s.num_generated, list(s.generated), s.state) for s in seqs] if retry else []
        try:
            results = self.runner.decode(seqs, riders) if riders else getattr(self.runner, phase)(seqs)
        except Exception as e:
            log.error("[%s] %s of %d failed: %s", self.name, phase, len(seqs), traceback.format_exc())
            if retry:
                results, failed = self._prefill_alone(seqs, before)
            else:
                results, failed = [], [(seq, e) for seq in [*seqs, *riders]]
        finally:
            self.phase_seconds[phase] += time.perf_counter() - t_phase
        for seq, e in failed:
            self._end(seq, None, EngineError(f"[{self.name}] {phase} failed: {e}"))
        if phase == "decode" and not failed:
            self.decoded_rows += len(seqs)
        emitted = time.perf_counter()
        for r in results:
            if r.output is not None and not r.seq.answered:
                r.seq.answered = True
                self.first_outputs += 1
                self.first_output_seconds += emitted - r.seq.added_at
            if r.finish_reason is None:
                if r.output is not None:
                    self.emit(r.seq.request_id, r.output, None, None)
            else:
                self._end(r.seq, r.output, None, r.finish_reason)

    def _prefill_alone(self, seqs: list[Sequence], before: list[tuple]) -> tuple[list, list]:
        """After a batched prefill failed: each sequence's prefill on its own, so that one bad prompt, or a
        batch too large for the device's memory, fails only the sequences that fail alone. Each starts from
        its fields as they were before the batch (`before`: num_generated, generated, state); the runner's
        prefill starts the slot afresh, so what the failed batch wrote there is overwritten. Returns the
        results and the (sequence, error) pairs that failed again."""
        results, failed = [], []
        for seq, (num_generated, generated, state) in zip(seqs, before):
            seq.num_generated, seq.generated, seq.state = num_generated, generated, state
            try:
                results += self.runner.prefill([seq])
            except Exception as e:
                log.error("[%s] prefill of %s alone failed: %s", self.name, seq.request_id, e)
                failed.append((seq, e))
        return results, failed

    def _end(self, seq: Sequence, output: Any, error: OmniError | None, finish_reason: str | None = None) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)
        self.emit(seq.request_id, output, finish_reason, error)
