# The engine loop with a pure-Python runner: ordering, aborts, failures and readiness, no torch.
import threading
import time

from omnistage.core.engine import StageEngine, StepResult
from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Scheduler, Sequence


class CountingRunner:
    """Emits the step number per sequence; finishes after params.max_tokens outputs."""

    def __init__(self, fail_on=None, gate=None):
        self.fail_on, self.gate = fail_on, gate
        self.released, self.batches = [], []

    def validate(self, seq):
        if seq.payload == "bad":
            raise BadRequestError("bad payload")

    def is_ready(self, seq):
        return self.gate is None or self.gate(seq)

    def prefill(self, seqs):
        return [self._step(s) for s in seqs]

    def decode(self, seqs):
        self.batches.append(sorted(s.request_id for s in seqs))
        if self.fail_on and any(s.request_id == self.fail_on for s in seqs):
            raise RuntimeError("boom")
        return [self._step(s) for s in seqs]

    def _step(self, s):
        s.num_generated += 1
        done = s.num_generated >= s.params.max_tokens
        return StepResult(s, s.num_generated, "length" if done else None)

    def release(self, seq):
        self.released.append(seq.request_id)


class Collector:
    def __init__(self):
        self.events, self.done = [], {}
        self.cv = threading.Condition()

    def __call__(self, rid, output, reason, error):
        with self.cv:
            self.events.append((rid, output, reason, error))
            if reason or error:
                self.done[rid] = reason or error
            self.cv.notify_all()

    def wait(self, *rids, timeout=5):
        with self.cv:
            assert self.cv.wait_for(lambda: all(r in self.done for r in rids), timeout), self.events

    def outputs(self, rid):
        return [o for r, o, _, _ in self.events if r == rid and o is not None]


def make(runner, slots=4):
    out = Collector()
    engine = StageEngine("test", runner, Scheduler(slots), out)
    engine.start()
    return engine, out


def serve_a3_b5(runner):
    """Requests a (3 tokens) and b (5 tokens) through a fresh engine, to the end; the engine is stopped."""
    engine, out = make(runner)
    for name, n in (("a", 3), ("b", 5)):
        engine.add(Sequence(name, SamplingParams(max_tokens=n), None))
    out.wait("a", "b")
    engine.stop()
    return engine, out


def test_batches_all_running_sequences_and_finishes_each():
    runner = CountingRunner()
    engine, out = serve_a3_b5(runner)
    assert out.outputs("a") == [1, 2, 3] and out.outputs("b") == [1, 2, 3, 4, 5]
    assert out.done == {"a": "length", "b": "length"}
    assert ["a", "b"] in runner.batches  # one decode step served both
    assert sorted(runner.released) == ["a", "b"] and engine.scheduler.slots_in_use == 0


def test_invalid_request_rejected_on_add():
    engine, _ = make(CountingRunner())
    try:
        engine.add(Sequence("x", SamplingParams(), "bad"))
    except BadRequestError:
        pass
    else:
        raise AssertionError("expected BadRequestError")
    finally:
        engine.stop()


def test_abort_frees_slot_and_ends_stream():
    gate_open = threading.Event()
    runner = CountingRunner(gate=lambda s: gate_open.is_set())
    engine, out = make(runner, slots=1)
    engine.add(Sequence("a", SamplingParams(max_tokens=100), None))
    engine.add(Sequence("b", SamplingParams(max_tokens=2), None))  # waits for a's slot
    time.sleep(0.1)
    engine.abort("a")
    gate_open.set()
    out.wait("a", "b")
    engine.stop()
    assert out.done["a"] == "abort" and out.done["b"] == "length"
    assert engine.scheduler.slots_in_use == 0


def test_failed_step_fails_its_sequences_not_the_engine():
    runner = CountingRunner(fail_on="bad-one")
    engine, out = make(runner)
    engine.add(Sequence("bad-one", SamplingParams(max_tokens=5), None))
    out.wait("bad-one")
    engine.add(Sequence("good", SamplingParams(max_tokens=2), None))
    out.wait("good")
    engine.stop()
    assert "failed" in str(out.done["bad-one"]) and out.done["good"] == "length"


class BatchFailingRunner(CountingRunner):
    """Its prefill fails any batch that `fails(request ids)` says should, after it has started the batch's
    sequences (as a runner's late failure would): counted a token, kept a token id, set a state."""

    def __init__(self, fails):
        super().__init__()
        self.fails, self.prefills = fails, []

    def prefill(self, seqs):
        ids = sorted(s.request_id for s in seqs)
        self.prefills.append(ids)
        results = super().prefill(seqs)
        for s in seqs:
            s.generated.append(7)
            s.state = "written"
        if self.fails(ids):
            raise RuntimeError(f"prefill of {ids} failed")
        return results


def _served_in_one_prefill(runner, requests):
    """The requests (id -> max_tokens) added before the engine starts, so that one step prefills them all."""
    out = Collector()
    engine = StageEngine("test", runner, Scheduler(4), out)
    for rid, n in requests.items():
        engine.add(Sequence(rid, SamplingParams(max_tokens=n), None))
    engine.start()
    out.wait(*requests)
    engine.stop()
    return engine, out


def test_a_failed_batched_prefill_retries_each_sequence_alone():
    """One bad prompt in a batched prefill fails alone; the others are prefilled again on their own, from
    their fields as they were before the batch, and stream as if nothing had happened."""
    runner = BatchFailingRunner(lambda ids: "poison" in ids)
    engine, out = _served_in_one_prefill(runner, {"a": 3, "poison": 3, "b": 2})
    assert runner.prefills == [["a", "b", "poison"], ["a"], ["poison"], ["b"]]  # batched, then each alone
    assert "prefill failed" in str(out.done["poison"]) and not out.outputs("poison")
    assert out.outputs("a") == [1, 2, 3] and out.outputs("b") == [1, 2]  # counted once, not twice
    assert out.done["a"] == out.done["b"] == "length"
    assert sorted(runner.released) == ["a", "b", "poison"] and engine.scheduler.slots_in_use == 0


def test_a_batch_too_large_for_one_prefill_succeeds_alone():
    runner = BatchFailingRunner(lambda ids: len(ids) > 1)  # e.g. out of memory for the batch's activations
    _, out = _served_in_one_prefill(runner, {"a": 2, "b": 2})
    assert runner.prefills == [["a", "b"], ["a"], ["b"]]
    assert out.done == {"a": "length", "b": "length"} and out.outputs("a") == out.outputs("b") == [1, 2]


def test_a_lone_failed_prefill_is_not_retried():
    runner = BatchFailingRunner(lambda ids: True)
    _, out = _served_in_one_prefill(runner, {"a": 2})
    assert runner.prefills == [["a"]] and "prefill failed" in str(out.done["a"])


def test_update_runs_on_engine_thread_and_wakes_gated_sequence():
    seen = {}
    runner = CountingRunner(gate=lambda s: s.payload is not None)
    engine, out = make(runner)
    engine.add(Sequence("a", SamplingParams(max_tokens=2), None))
    time.sleep(0.1)
    assert "a" not in out.done  # prefilled, then gated

    def unblock(seq):
        seen["thread"] = threading.current_thread().name
        seq.payload = "go"

    engine.update("a", unblock)
    out.wait("a")
    engine.stop()
    assert seen["thread"] == "test-engine"


class SlowRunner(CountingRunner):
    """Each phase sleeps a known time, so the engine's per-phase seconds can be checked against it."""

    PREFILL_S, DECODE_S = 0.03, 0.01

    def prefill(self, seqs):
        time.sleep(self.PREFILL_S)
        return super().prefill(seqs)

    def decode(self, seqs):
        time.sleep(self.DECODE_S)
        return super().decode(seqs)


def test_stats_count_phase_seconds_and_decoded_rows():
    runner = SlowRunner()
    engine, _ = serve_a3_b5(runner)
    s = engine.stats()
    decode_steps = len(runner.batches)
    assert s["decoded_rows"] == sum(len(b) for b in runner.batches) == (3 - 1) + (5 - 1)  # the prefill emits one
    assert decode_steps * SlowRunner.DECODE_S <= s["decode_seconds"] < decode_steps * SlowRunner.DECODE_S + 0.5
    # one or two prefill calls (both requests may be admitted in the same step), never counted as decode time
    assert SlowRunner.PREFILL_S <= s["prefill_seconds"] < 2 * SlowRunner.PREFILL_S + 0.5


def test_counts_each_sequences_wait_for_its_prefill_and_first_output():
    """queue: arrival -> the prefill that took it; first output: arrival -> its first output emitted. A
    prefill held back by a slow step shows in both, and each sequence counts once however many outputs."""
    slow = threading.Event()

    class SlowFirstDecode(CountingRunner):
        def decode(self, seqs):
            if not slow.is_set():
                slow.set()
                time.sleep(0.2)  # "b" arrives during this step and waits for it
            return super().decode(seqs)

    engine, out = make(SlowFirstDecode())
    engine.add(Sequence("a", SamplingParams(max_tokens=3), None))
    assert slow.wait(5)
    engine.add(Sequence("b", SamplingParams(max_tokens=2), None))
    out.wait("a", "b")
    engine.stop()
    s = engine.stats()
    assert s["prefilled_rows"] == 2 and s["first_outputs"] == 2
    assert 0.1 < s["queue_seconds"] < 1.0  # b waited out (most of) the 0.2 s step; a not at all
    assert s["queue_seconds"] <= s["first_output_seconds"] < 1.0


def test_a_sequence_prefilled_in_a_step_decodes_in_it_when_ready():
    """Its second output leaves in the step of its first; one not ready waits for a later step."""
    held = {"b"}
    runner = CountingRunner(gate=lambda s: s.request_id not in held)
    engine, out = make(runner)
    engine.add(Sequence("a", SamplingParams(max_tokens=3), None))
    engine.add(Sequence("b", SamplingParams(max_tokens=3), None))
    out.wait("a")
    assert runner.batches[0] == ["a"]  # a: prefill (output 1) and decode (output 2) in step 1; b held back
    assert out.outputs("a") == [1, 2, 3] and len(runner.batches) == 2
    held.clear()
    out.wait("b")
    engine.stop()
    assert out.outputs("b") == [1, 2, 3]


def test_a_prefill_output_leaves_before_the_same_steps_decode_runs():
    """A request's first output (the next stage's start) is handed on when the prefill phase ends, not after
    the decode phase of the same step; the outputs stay in order. A sequence that ends at its prefill ends
    at once."""
    runner = CountingRunner()
    emitted_before_decode = []
    out = Collector()
    engine = StageEngine("test", runner, Scheduler(4), out)
    real_decode = runner.decode

    def decode(seqs):
        emitted_before_decode.append(list(out.events))
        return real_decode(seqs)

    runner.decode = decode
    engine.start()
    engine.add(Sequence("one", SamplingParams(max_tokens=1), None))  # ends at its prefill
    out.wait("one")
    engine.add(Sequence("a", SamplingParams(max_tokens=3), None))
    out.wait("a")
    engine.stop()
    assert [o for r, o, _, _ in emitted_before_decode[0] if r == "a"] == [1], "a's first output precedes its decode"
    assert out.outputs("a") == [1, 2, 3] and out.done == {"one": "length", "a": "length"}


def test_the_runners_prompt_lengths_bound_a_steps_prefills():
    class SizedRunner(CountingRunner):
        def __init__(self):
            super().__init__()
            self.prefilled = []

        def prompt_tokens(self, seq):
            return seq.payload

        def prefill(self, seqs):
            self.prefilled.append([s.request_id for s in seqs])
            return super().prefill(seqs)

    runner, out = SizedRunner(), Collector()
    engine = StageEngine("test", runner, Scheduler(8, max_prefills_per_step=8, max_prefill_tokens=100), out)
    for name, tokens in (("a", 60), ("b", 60), ("c", 30)):  # queued before the loop starts: one schedule sees all
        engine.add(Sequence(name, SamplingParams(max_tokens=1), tokens))
    engine.start()
    out.wait("a", "b", "c")
    engine.stop()
    assert runner.prefilled == [["a"], ["b", "c"]]


class HeldValidation(CountingRunner):
    """validate() of a sequence whose payload is "held" waits for `go`; "bad" payloads are refused."""

    def __init__(self):
        super().__init__()
        self.go, self.entered = threading.Event(), threading.Event()

    def validate(self, seq):
        if seq.payload == "held":
            self.entered.set()
            assert self.go.wait(5)
        super().validate(seq)


def test_add_async_validates_beside_the_caller_and_serves_or_refuses():
    runner = HeldValidation()
    engine, out = make(runner)
    refused = []
    engine.add_async(Sequence("slow", SamplingParams(max_tokens=2), "held"), refused.append)
    assert runner.entered.wait(5)
    engine.add(Sequence("quick", SamplingParams(max_tokens=1), None))  # the caller goes on meanwhile
    out.wait("quick")
    assert "slow" not in out.done
    runner.go.set()
    engine.add_async(Sequence("bad", SamplingParams(), "bad"), refused.append)
    out.wait("slow")
    deadline = time.monotonic() + 5
    while not refused and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert out.outputs("slow") == [1, 2] and out.done["slow"] == "length"
    assert [type(e) for e in refused] == [BadRequestError] and "bad" not in out.done  # refused, not emitted


def test_an_abort_during_add_asyncs_validation_ends_the_sequence_unqueued():
    runner = HeldValidation()
    engine, out = make(runner)
    engine.add_async(Sequence("a", SamplingParams(max_tokens=100), "held"), lambda e: None)
    assert runner.entered.wait(5)
    engine.abort("a")  # before its add is queued: lost to the engine, unless add_async keeps it
    runner.go.set()
    out.wait("a")
    engine.add(Sequence("b", SamplingParams(max_tokens=1), None))
    out.wait("b")
    engine.stop()
    assert out.done["a"] == "abort" and out.outputs("a") == []
    assert "a" not in runner.released and engine.scheduler.slots_in_use == 0  # never held a slot
