# Code2Wav as a stage engine, driven without Triton on the tiny checkpoint's Code2Wav: a lane batches streams
# at different positions into one forward; sessions streamed through the stage's lanes (first lane, later
# decoder or eager) equal the full decode; a stream's state stays in the stage (only frames in, samples out);
# finish, abort, bad chunks and sessions left idle free or refuse sessions as they should.
import queue
import threading
import time

import pytest
import torch

from omnistage.core.engine import ABORTED
from omnistage.core.errors import BadRequestError, OverloadedError
from omnistage.core.protocol import CODE2WAV
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Sequence
from omnistage.models.checkpoint import load_stage
from omnistage.stages.code2wav import Code2WavRunner, native_cpu_convs
from omnistage.stages.code2wav_later import LaterChunkDecoder
from omnistage.stages.code2wav_stage import (
    EAGER_FORWARD_SLICES,
    Code2WavChunk,
    Code2WavLane,
    Code2WavSessions,
    Code2WavStage,
)
from omnistage.stages.step_stream import StepStream

TOL = 1e-5
SPF, TAIL = 1920, 555


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def runner(tiny_checkpoint):
    return Code2WavRunner(load_stage(tiny_checkpoint, "code2wav", torch.float32, "cpu"), "cpu", torch.float32)


def codes_of(frames, seed):
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def full_decode(runner, codes):
    with torch.inference_mode(), native_cpu_convs():
        return runner.module(codes.T[None])[0, 0].float()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class Answers:
    """The stage's emit: each session's answers, in order."""

    def __init__(self):
        self.by_session: dict[str, queue.SimpleQueue] = {}

    def __call__(self, session, output, finish_reason, error):
        self.by_session.setdefault(session, queue.SimpleQueue()).put((output, finish_reason, error))

    def next(self, session, timeout=60):
        return self.by_session.setdefault(session, queue.SimpleQueue()).get(timeout=timeout)


def chunked(frames, first, size):
    """The schedule's windows over `frames` frames, as (start, end)."""
    bounds, start = [], 0
    while start < frames:
        end = min(frames, start + (first if start == 0 else size))
        bounds.append((start, end))
        start = end
    return bounds


def stream_through(stage, answers, session, codes, first, size, end_alone=False):
    """Sends a stream chunk by chunk (each once the last one's audio is back) and returns its audio."""
    pieces, windows = [], chunked(codes.shape[0], first, size)
    for k, (start, end) in enumerate(windows):
        last = k == len(windows) - 1 and not end_alone
        stage.submit(session, codes[start:end], start=k == 0, end=last)
        output, reason, error = answers.next(session)
        assert error is None and reason == "stop", (reason, error)
        assert output.audio.shape == (runner_samples(end - start, start),)
        pieces.append(output.audio)
    if end_alone:  # the frames ended on a chunk boundary: the end comes with no frames
        stage.submit(session, None, start=False, end=True)
        output, reason, error = answers.next(session)
        assert error is None and reason == "stop" and output.audio is None
    return torch.cat(pieces)


def runner_samples(frames, position):
    return frames * SPF - (TAIL if position == 0 else 0)


def seq(session_id, codes, session, end=False):
    return Sequence(session_id, SamplingParams(), Code2WavChunk(codes, session, end))


@pytest.mark.parametrize("later_chunk_batch, forwards", [(0, 3), (4, 1), (2, 2)])
def test_a_lane_batches_streams_at_different_positions(runner, later_chunk_batch, forwards):
    """Streams at positions 4, 29 and 54 (K/V window and conv context still filling, then full) with a
    chunk each in one decode: with the later decoder (static shapes) one forward for all three, or two
    slices of at most 2, where eager runs one forward per shape; either way each stream's audio and state
    equal decoding it alone."""
    sessions = Code2WavSessions()
    later = LaterChunkDecoder(runner, 25, later_chunk_batch, False) if later_chunk_batch else None
    lane = Code2WavLane(runner, sessions, 64, StepStream("cpu", False), False, later=later)
    streams = [codes_of(80, seed=s) for s in range(3)]
    opened = [sessions.take(f"s{i}", start=True) for i in range(3)]
    for i, (codes, session) in enumerate(zip(streams, opened)):  # advance stream i by 4 + 25 * i frames
        for start, end in chunked(4 + 25 * i, 4, 25):
            [(_, session.state)] = runner.decode([(codes[start:end], session.state)])
    chunks = [seq(f"s{i}", codes[4 + 25 * i : 4 + 25 * i + 25], session) for i, (codes, session) in
              enumerate(zip(streams, opened))]  # fmt: skip
    alone = [runner.decode([(c.payload.codes, c.payload.session.state)])[0] for c in chunks]
    before, pending, answered = runner.forwards, list(chunks), {}
    while pending:  # the engine's decode steps: each decodes one group, the rest wait
        results = lane.decode(pending)
        done = [r for r in results if r.finish_reason is not None]
        assert done and all(r.finish_reason == "stop" for r in done)
        answered.update({r.seq.request_id: r.output.audio for r in done})
        pending = [r.seq for r in results if r.finish_reason is None]
    assert runner.forwards - before == forwards
    for c, (audio, state) in zip(chunks, alone):
        assert rel_err(answered[c.request_id], audio) < TOL
        new = c.payload.session.state  # resident: the lane wrote it back into the session
        assert new.position == state.position and torch.allclose(new.kv, state.kv, atol=1e-6)
        assert torch.allclose(new.hidden, state.hidden, atol=1e-6)


def test_a_group_of_one_shape_beyond_the_later_batch_runs_eager(runner):
    """Five streams at one position (they started together) with a chunk each, the later decoder taking 2
    at a time: one eager forward for the five, not three slices; each stream's audio equals decoding it
    alone."""
    assert -(-5 // 2) > EAGER_FORWARD_SLICES * 1
    sessions = Code2WavSessions()
    lane = Code2WavLane(runner, sessions, 64, StepStream("cpu", False), False,
                        later=LaterChunkDecoder(runner, 25, 2, False))  # fmt: skip
    streams = [codes_of(40, seed=s) for s in range(5)]
    opened = [sessions.take(f"s{i}", start=True) for i in range(5)]
    for codes, session in zip(streams, opened):
        [(_, session.state)] = runner.decode([(codes[:4], session.state)])
    chunks = [seq(f"s{i}", codes[4:29], session) for i, (codes, session) in enumerate(zip(streams, opened))]
    alone = [runner.decode([(c.payload.codes, c.payload.session.state)])[0][0] for c in chunks]
    before = runner.forwards
    results = lane.decode(chunks)
    assert runner.forwards - before == 1 and lane.later.chunks == 0
    for result, audio in zip(results, alone):
        assert result.finish_reason == "stop" and rel_err(result.output.audio, audio) < TOL


@pytest.mark.parametrize("later_chunk_batch", [0, 4])
def test_streams_through_the_stage_equal_the_full_decode(runner, later_chunk_batch):
    """Four sessions at once on the stage's threads: first chunks of 4 frames through the first lane, the rest
    through the main lane; each stream's concatenated audio equals the full decode of its frames."""
    answers = Answers()
    stage = Code2WavStage(runner, answers, first_chunk_frames=[4], later_chunk_batch=later_chunk_batch)
    stage.start()
    try:
        cases = [(60, 4, 25, False), (54, 4, 25, True), (33, 7, 13, False), (3, 4, 25, False)]
        results = {}

        def run(i, frames, first, size, end_alone):
            codes = codes_of(frames, seed=10 + i)
            results[i] = (codes, stream_through(stage, answers, f"s{i}", codes, first, size, end_alone))

        threads = [threading.Thread(target=run, args=(i, *case)) for i, case in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1, 2, 3]
        for codes, audio in results.values():
            assert rel_err(audio, full_decode(runner, codes)) < TOL
        stats = stage.stats()
        assert stats["sessions"] == 0 and stats["queued"] == 0  # every stream ended: all state freed
        assert stats["first_chunks"] == 2  # the 4-frame first chunks; 7 and 3 frames go to the main lane
        assert stats["chunks"] == 4 + 3 + 3 + 1  # the end that came alone decoded nothing
        assert stats["later_chunks"] == (3 + 2 + 2 if later_chunk_batch else 0)
    finally:
        stage.stop()


def test_only_frames_cross_the_hop():
    """The code2wav contract carries codec frames in and samples out, no state; what the stage answers is
    the chunk's samples alone."""
    assert [t.name for t in CODE2WAV.inputs] == ["codes"]
    assert [t.name for t in CODE2WAV.outputs] == ["audio"]
    assert {"session", "action", "end"} <= set(CODE2WAV.parameters)


def test_an_answer_is_only_samples(runner):
    answers = Answers()
    stage = Code2WavStage(runner, answers)
    stage.start()
    try:
        stage.submit("s", codes_of(6, seed=1), start=True, end=False)
        output, reason, error = answers.next("s")
        assert error is None and reason == "stop"
        assert list(vars(output)) == ["audio", "error"] and output.error is None
        assert output.audio.dtype == torch.float32 and output.audio.shape == (6 * SPF - TAIL,)
        assert stage.stats()["sessions"] == 1  # the state stays here for the next chunk
    finally:
        stage.stop()


def test_abort_frees_the_session_and_ends_its_chunk_in_flight(runner):
    answers = Answers()
    stage = Code2WavStage(runner, answers, first_chunk_frames=[4])
    # queued before the lanes run, so the abort reaches the chunk while it is still in flight
    stage.submit("a", codes_of(4, seed=2), start=True, end=False)
    stage.submit("b", codes_of(5, seed=3), start=True, end=False)
    assert stage.stats()["sessions"] == 2
    stage.abort("a")
    stage.start()
    try:
        assert answers.next("a") == (None, ABORTED, None)
        output, reason, _ = answers.next("b")
        assert reason == "stop" and output.audio.shape == (5 * SPF - TAIL,)
        assert stage.stats()["sessions"] == 1
        stage.abort("b")  # between chunks: nothing in flight, the state is dropped
        assert stage.stats()["sessions"] == 0
        for session in ("a", "b"):
            with pytest.raises(BadRequestError, match="no open code2wav session"):
                stage.submit(session, codes_of(5, seed=4), start=False, end=False)
    finally:
        stage.stop()


def test_bad_chunks_are_refused_before_anything_is_queued(runner):
    answers = Answers()
    stage = Code2WavStage(runner, answers, max_sessions=2)
    good = codes_of(5, seed=5)
    bad = [(good.clone().fill_(2048), r"\[0, 2048\)"), (good.float(), "integers"), (good[:, :15], "must be"),
           (None, "codes is required")]  # fmt: skip
    for codes, match in bad:
        with pytest.raises(BadRequestError, match=match):
            stage.submit("s", codes, start=True, end=False)
    assert stage.stats()["sessions"] == 0  # nothing was opened
    stage.submit("s", good, start=True, end=False)
    with pytest.raises(BadRequestError, match="already open"):
        stage.submit("s", good, start=True, end=False)
    with pytest.raises(BadRequestError, match="chunk in flight"):
        stage.submit("s", good, start=False, end=False)
    with pytest.raises(BadRequestError, match="no open code2wav session"):
        stage.submit("t", good, start=False, end=False)
    stage.submit("t", good, start=True, end=True)
    with pytest.raises(OverloadedError, match="2 sessions open"):
        stage.submit("u", good, start=True, end=False)
    stage.start()
    try:
        assert answers.next("s")[1] == answers.next("t")[1] == "stop"
        assert stage.stats()["sessions"] == 1  # t ended with its last chunk; s is open
    finally:
        stage.stop()



def test_a_session_left_idle_is_closed(runner):
    """A caller that dies between two chunks sends neither the end nor an abort: the session's state goes after
    session_idle_s; a session with a chunk in flight or one still fed stays."""
    answers = Answers()
    stage = Code2WavStage(runner, answers, session_idle_s=0.5)
    stage.start()
    try:
        for session in ("fed", "orphan"):
            stage.submit(session, codes_of(5, seed=6), start=True, end=False)
            assert answers.next(session)[1] == "stop"
        deadline = time.monotonic() + 60
        while "orphan" in stage.sessions._open and time.monotonic() < deadline:
            stage.submit("fed", codes_of(5, seed=7), start=False, end=False)  # its caller keeps sending chunks
            assert answers.next("fed")[1] == "stop"
            time.sleep(0.1)
        assert stage.stats()["sessions"] == 1 and stage.stats()["sessions_expired"] == 1
        with pytest.raises(BadRequestError, match="no open code2wav session 'orphan'.*idle too long"):
            stage.submit("orphan", codes_of(5, seed=8), start=False, end=False)
        stage.submit("fed", codes_of(5, seed=9), start=False, end=True)
        assert answers.next("fed")[1] == "stop"
        assert stage.stats()["sessions"] == 0 and stage.stats()["sessions_expired"] == 1
    finally:
        stage.stop()


def test_expiry_spares_a_session_whose_chunk_is_in_flight():
    sessions = Code2WavSessions()
    busy = sessions.take("busy", start=True)  # queued, not answered yet
    idle = sessions.take("idle", start=True)
    sessions.done("idle", idle, close=False)
    now = time.monotonic() + 3600
    assert sessions.expire(60, now) == ["idle"] and len(sessions) == 1
    sessions.done("busy", busy, close=False)
    assert sessions.expire(60) == [] and sessions.expire(60, time.monotonic() + 61) == ["busy"]


@pytest.mark.gpu
def test_stage_on_cuda_with_graphs_equals_eager(tiny_checkpoint):
    """The served CUDA path: first chunks through the first lane's graphs on its high-priority stream, later
    chunks through the later decoder's graphs, audio handed over in pinned host memory; each stream equals
    the runner's eager decode of the same chunks."""
    runner = Code2WavRunner(load_stage(tiny_checkpoint, "code2wav", torch.bfloat16, "cuda"), "cuda", torch.bfloat16)
    answers = Answers()
    stage = Code2WavStage(runner, answers, first_chunk_frames=[1, 4])
    stage.start()
    try:
        streams = {f"s{i}": (codes_of(40 + 7 * i, seed=70 + i), (1, 4)[i % 2]) for i in range(6)}
        results = {}

        def run(session, codes, first):
            results[session] = stream_through(stage, answers, session, codes, first, 25)

        threads = [threading.Thread(target=run, args=(s, c, f)) for s, (c, f) in streams.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for session, (codes, first) in streams.items():
            state, pieces = None, []
            for start, end in chunked(codes.shape[0], first, 25):
                [(audio, state)] = runner.decode([(codes[start:end], state)])
                pieces.append(audio.float().cpu())
            assert results[session].device.type == "cpu"
            assert rel_err(results[session].float().cpu(), torch.cat(pieces)) < 2e-2
        stats = stage.stats()
        assert stats["first_chunks"] == 6 and stats["later_chunks"] > 0 and stats["sessions"] == 0
    finally:
        stage.stop()
