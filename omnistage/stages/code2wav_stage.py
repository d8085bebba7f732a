# Code2Wav as a stage engine. Each stream is a session whose carried state (StreamState: the
# pre-transformer's K/V window and the conv context, ~2.3 MB per stream at full size in bf16) stays in this
# process, on the device, from the stream's first chunk to its last: a caller sends only each chunk's codec
# frames and gets back the chunk's final samples. A session takes one chunk at a time (its next chunk needs
# the state this one leaves), and each chunk is a job of its own: one Sequence of a StageEngine, admitted,
# decoded in one step and finished with its audio, so every chunk request gets exactly one response.
#
# Two lanes, each a StageEngine on a thread of its own. New streams' first chunks of the schedule's lengths
# go to the first lane, which runs on a high-priority CUDA stream and replays CUDA graphs per batch bucket
# (code2wav_first.py): the chunk a time to first audio waits for never queues behind a forward of later
# chunks (~100 ms at 64 streams on the H200). Every other chunk goes to the main lane, where later chunks
# are padded to static shapes and replayed as CUDA graphs (code2wav_later.py); a large group of few shapes
# and the rest run eager, by shape. A lane decodes one forward's group per step (take_group: the lowest key,
# oldest first), so what arrives meanwhile is admitted before the next group is taken.
#
# A session whose caller dies between two chunks gets neither its end nor an abort: a sweeper thread closes
# sessions left idle (no chunk in flight) for session_idle_s, so their state does not stay resident for good.
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..core.engine import Emit, StageEngine, StepResult
from ..core.errors import BadRequestError, EngineError, OmniError, OverloadedError
from ..core.sampling import SamplingParams
from ..core.scheduler import Scheduler, Sequence
from .code2wav import ChunkIn, ChunkOut, Code2WavRunner, StreamState, chunk_key, take_group
from .code2wav_first import FirstChunkDecoder
from .code2wav_later import LaterChunkDecoder
from .host_copy import sync_current_stream, to_host
from .step_stream import StepStream

log = logging.getLogger(__name__)

# On CUDA the main lane decodes up to this many later chunks (carried state, up to chunk_frames frames) as one
# forward padded to static shapes, replayed as a CUDA graph: a lone stream's eager 25-frame chunk takes ~28 ms
# of launches for a few ms of kernels, and its last chunk is on the way to the end of the reply. Measured on
# the H200: perf/results/h200-router-later-chunks.json
LATER_CHUNK_BATCH = 4
# A larger group goes through those graphs in slices while they are at most this many per shape that eager
# would run (Code2WavLane._decode). On an H100 an eager forward cost ~15 ms plus its work and a slice of 4
# chunks ~7.5 ms: 8 realtime sessions' chunks of 6 shapes took 14 ms in slices against 102 ms eager, 32 of
# them 58 against 69-108 ms, while 16 text-to-speech streams at one position took 21 ms eager against 32 ms
# in slices (perf/results/h100-code2wav-groups.json).
EAGER_FORWARD_SLICES = 2
# Open sessions per stage instance: one per request speaking through it (omni_ensemble's max_inflight per
# orchestrator bounds them well below this); a session holds its state on the device until it ends.
MAX_SESSIONS = 1024
SWEEP_SECONDS = 1.0  # the sweeper's period at most: an idle session goes within session_idle_s + this
_NO_SAMPLING = SamplingParams()  # a chunk samples nothing; Sequence wants params


@dataclass(eq=False)
class Code2WavSession:
    state: StreamState | None = None  # after the chunks decoded so far; None before the first
    busy: bool = False  # a chunk of it is queued or being decoded
    idle_since: float = 0.0  # time.monotonic() its last chunk was answered (or it opened)


@dataclass(eq=False)
class Code2WavChunk:  # a chunk job's payload
    codes: torch.Tensor | None  # [n, Q] new frames; None: the session's end, with no frames left
    session: Code2WavSession
    end: bool  # the session's last chunk: the session closes once it is answered
    decoded: bool = False


@dataclass
class Code2WavAudio:
    audio: torch.Tensor | None  # [samples] float32: the chunk's samples that became final; None: no frames
    error: OmniError | None = None  # its group's decode failed (the stage answers with the error)


class Code2WavSessions:
    """The open sessions by id; thread-safe (requests arrive on Triton's thread, chunks end on the lanes')."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._open: dict[str, Code2WavSession] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def take(self, session_id: str, start: bool) -> Code2WavSession:
        """The session for its next chunk, marked busy; start opens it."""
        with self._lock:
            session = self._open.get(session_id)
            if start:
                if session is not None:
                    raise BadRequestError(f"code2wav session {session_id!r} is already open")
                if len(self._open) >= self.max_sessions:
                    raise OverloadedError(f"code2wav has {self.max_sessions} sessions open")
                session = self._open[session_id] = Code2WavSession(idle_since=time.monotonic())
            elif session is None:
                raise BadRequestError(f"no open code2wav session {session_id!r}: a stream starts with action "
                                      "'start' and ends with its chunk marked 'end' or an abort; a session "
                                      "idle too long is closed")  # fmt: skip
            if session.busy:
                raise BadRequestError(f"code2wav session {session_id!r} has a chunk in flight: send the next "
                                      "once its audio is back")  # fmt: skip
            session.busy = True
            return session

    def done(self, session_id: str, session: Code2WavSession, close: bool) -> None:
        with self._lock:
            session.busy, session.idle_since = False, time.monotonic()
            if close and self._open.get(session_id) is session:
                del self._open[session_id]

    def expire(self, idle_s: float, now: float | None = None) -> list[str]:
        """Closes the sessions with no chunk in flight whose last chunk was answered idle_s or more before
        `now`; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [i for i, s in self._open.items() if not s.busy and now - s.idle_since >= idle_s]
            for session_id in expired:
                del self._open[session_id]
        return expired

    def close(self, session_id: str) -> None:
        with self._lock:
            self._open.pop(session_id, None)


class Code2WavLane:
    """The StageRunner of one lane; each sequence is one chunk. prefill() only admits; decode() decodes the
    group of ready chunks with the lowest key and finishes them, the others wait for the next step."""

    def __init__(self, runner: Code2WavRunner, sessions: Code2WavSessions, max_batch: int, stream: StepStream,
                 host_outputs: bool, first: list[FirstChunkDecoder] = (), later: LaterChunkDecoder | None = None):  # fmt: skip
        self.runner, self.sessions, self.max_batch, self.stream = runner, sessions, max_batch, stream
        # host_outputs: the audio leaves in pinned host memory, copied at the group's one sync
        self.host_outputs = host_outputs
        self.first, self.later = list(first), later
        self.chunks = self.groups = self.last_group = 0
        self.last_decoded = 0.0  # perf_counter() when its last group was decoded

    def validate(self, seq: Sequence) -> None:
        pass  # Code2WavStage.submit checks a chunk before its session is taken

    def is_ready(self, seq: Sequence) -> bool:
        return True

    def prefill(self, seqs: list[Sequence]) -> list[StepResult]:
        return [StepResult(seq, None) for seq in seqs]

    def release(self, seq: Sequence) -> None:
        chunk: Code2WavChunk = seq.payload  # a chunk that ended undecoded (aborted, failed) ends its session
        self.sessions.done(seq.request_id, chunk.session, close=chunk.end or not chunk.decoded)

    def decode(self, seqs: list[Sequence]) -> list[StepResult]:
        ends = [s for s in seqs if s.payload.codes is None]
        group, rest = take_group([s for s in seqs if s.payload.codes is not None], self._key, self.max_batch) \
            if len(ends) < len(seqs) else ([], [])  # fmt: skip
        results = [StepResult(s, None) for s in rest]
        for seq in ends:
            seq.payload.decoded = True
            results.append(StepResult(seq, Code2WavAudio(None), "stop"))
        if group:
            results += self._decode_group(group)
        return results

    def _decode_group(self, group: list[Sequence]) -> list[StepResult]:
        # A failure fails this group's chunks only (the engine would fail every chunk of the step with it)
        try:
            with self.stream.run():
                done = self._decode([(s.payload.codes, s.payload.session.state) for s in group])
                audio = [to_host(wav) if self.host_outputs else wav for wav, _ in done]
                if self.host_outputs:
                    sync_current_stream(self.runner.device)
        except Exception as e:
            log.exception("[code2wav] decode of %d chunks failed", len(group))
            error = EngineError(f"[code2wav] decode failed: {e}")
            return [StepResult(seq, Code2WavAudio(None, error), "error") for seq in group]
        for seq, (_, state) in zip(group, done):
            seq.payload.session.state, seq.payload.decoded = state, True
        self.chunks, self.groups, self.last_group = self.chunks + len(group), self.groups + 1, len(group)
        self.last_decoded = time.perf_counter()
        return [StepResult(seq, Code2WavAudio(wav), "stop") for seq, wav in zip(group, audio)]

    def _key(self, seq: Sequence) -> tuple:
        """New streams' chunks first, by shape; then every chunk the later decoder takes (one group); then
        the other chunks by shape."""
        chunk: ChunkIn = (seq.payload.codes, seq.payload.session.state)
        if self.later is not None and self.later.fits([chunk]):
            return (1,)
        return (0 if chunk[1] is None else 2, *chunk_key(*chunk))

    def _decode(self, chunks: list[ChunkIn]) -> list[ChunkOut]:
        """One group (one key): through a static-shape decoder that takes it (CUDA graphs with cuda_graphs),
        else eager, one forward per shape. A group of later chunks larger than the later decoder's batch goes
        through it in slices unless eager takes fewer than 1 / EAGER_FORWARD_SLICES as many forwards: the
        ramped chunks of realtime sessions come in a few shapes, each eager forward ~550 kernel launches,
        while streams that started together share one shape, and there a forward's work bounds it."""
        first = next((d for d in self.first if len(chunks) <= d.max_batch and d.fits(chunks)), None)
        if first is not None:
            return first.decode(chunks)
        later = self.later
        if later is not None and later.fits(chunks):
            shapes = len({chunk_key(*chunk) for chunk in chunks})
            if -(-len(chunks) // later.max_batch) <= EAGER_FORWARD_SLICES * shapes:
                return later.decode(chunks)
        out: list[ChunkOut | None] = [None] * len(chunks)
        for done in self.runner.decode_groups(chunks, check_ranges=False):  # submit checked the ranges
            for i, result in done:
                out[i] = result
        return out


class Code2WavStage:
    """The sessions and the two lanes of one Code2Wav instance. emit(session, Code2WavAudio | None,
    finish_reason, error) answers a chunk (always final: "stop", or "abort" with no output); emit_first, if
    given, answers the first lane's chunks (a response thread of their own). On CUDA the static-shape
    decoders replay CUDA graphs and the audio leaves in pinned host memory (stages/host_copy.py); the CPU
    runs the same code eagerly, with the later decoder only where later_chunk_batch asks for it (tests).
    session_idle_s: a session with no chunk for this long is closed (None: never)."""

    def __init__(self, runner: Code2WavRunner, emit: Emit, *, max_batch: int = 64, first_chunk_frames=(),
                 chunk_frames: int = 25, later_chunk_batch: int | None = None, emit_first: Emit | None = None,
                 max_sessions: int = MAX_SESSIONS, session_idle_s: float | None = None):  # fmt: skip
        self.runner = runner
        self.sessions = Code2WavSessions(max_sessions)
        self.session_idle_s, self.sessions_expired = session_idle_s, 0
        self._stop_sweeping = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="code2wav-sessions", daemon=True)
        cuda_graphs = host_outputs = runner.device.type == "cuda"
        if later_chunk_batch is None:
            later_chunk_batch = LATER_CHUNK_BATCH if cuda_graphs else 0
        first = [FirstChunkDecoder(runner, n, max_batch, cuda_graphs) for n in sorted(set(first_chunk_frames) - {0})]
        later = LaterChunkDecoder(runner, chunk_frames, later_chunk_batch, cuda_graphs) if later_chunk_batch else None
        # the first lane's inputs are host tensors or complete CUDA copies (the Python backend copies
        # synchronously), so it does not wait for the default stream, where the main lane may be running
        first_stream = StepStream(runner.device, True, priority=-1, wait_default=False)
        self.lanes = {
            "first": Code2WavLane(runner, self.sessions, max_batch, first_stream, host_outputs, first=first),
            "main": Code2WavLane(runner, self.sessions, max_batch, StepStream(runner.device, enabled=False),
                                 host_outputs, later=later),  # the main lane: the caller's stream
        }  # fmt: skip
        emits = {"first": _answer(emit_first or emit), "main": _answer(emit)}
        # a slot per chunk in flight: at most one per session
        self.engines = {lane: StageEngine(f"code2wav-{lane}" if lane == "first" else "code2wav", runner_,
                                          Scheduler(max_sessions, max_sessions, max_sessions), emits[lane])
                        for lane, runner_ in self.lanes.items() if lane == "main" or first}  # fmt: skip

    def start(self) -> None:
        """Captures the CUDA graphs (before serving: capture needs the device to itself), then starts the lanes."""
        for decoder in self.lanes["first"].first + [d for d in [self.lanes["main"].later] if d is not None]:
            decoder.capture_all()
        for engine in self.engines.values():
            engine.start()
        if self.session_idle_s is not None:
            self._sweeper.start()

    def stop(self) -> None:
        self._stop_sweeping.set()
        for engine in self.engines.values():
            engine.stop()

    def _sweep(self) -> None:
        while not self._stop_sweeping.wait(min(SWEEP_SECONDS, self.session_idle_s / 4)):
            for session_id in self.sessions.expire(self.session_idle_s):
                self.sessions_expired += 1
                log.warning("[code2wav] session %s closed after %.0fs without a chunk (its caller is gone)",
                            session_id, self.session_idle_s)  # fmt: skip

    def lane(self, codes: torch.Tensor | None, start: bool) -> str:
        """The lane a chunk goes to: "first" for a stream's first chunk of a first-lane length, else "main"."""
        chunk = [(codes, None)]
        first = start and isinstance(codes, torch.Tensor) and codes.dim() == 2
        return "first" if first and any(d.fits(chunk) for d in self.lanes["first"].first) else "main"

    def submit(self, session_id: str, codes: torch.Tensor | None, *, start: bool, end: bool) -> str:
        """Queues a chunk of a session: start, its first (which opens it); end, its last (after which the
        session closes); codes None: an end with no frames left. Returns the chunk's lane. A bad chunk raises
        BadRequestError (an OverloadedError past max_sessions) before anything is queued."""
        if codes is None:
            if start or not end:
                raise BadRequestError("codes is required (only a stream's end may come without frames)")
        else:
            self.runner.check(codes, None)
            [error] = self.runner.range_errors([codes])  # host codes, as served: no device sync
            if error is not None:
                raise BadRequestError(error)
        lane = self.lane(codes, start)
        session = self.sessions.take(session_id, start)
        self.engines[lane].add(Sequence(session_id, _NO_SAMPLING, Code2WavChunk(codes, session, end)))
        return lane

    def abort(self, session_id: str) -> None:
        """Ends the session: its chunk in flight, if any, is answered "abort"; its state is dropped."""
        self.sessions.close(session_id)
        for engine in self.engines.values():
            engine.abort(session_id)

    def stats(self) -> dict:
        engines = {lane: engine.stats() for lane, engine in self.engines.items()}
        first = engines.get("first", {})
        later = self.lanes["main"].later
        return {
            "sessions": len(self.sessions),
            "sessions_expired": self.sessions_expired,
            "queued": sum(s["running"] + s["waiting"] for s in engines.values()),
            "chunks": sum(lane.chunks for lane in self.lanes.values()),
            "groups": sum(lane.groups for lane in self.lanes.values()),
            "last_group": max(self.lanes.values(), key=lambda lane: lane.last_decoded).last_group,
            "forwards": self.runner.forwards,
            "busy_seconds": sum(s["prefill_seconds"] + s["decode_seconds"] for s in engines.values()),
            "first_lane_seconds": first.get("prefill_seconds", 0.0) + first.get("decode_seconds", 0.0),
            "first_chunks": self.lanes["first"].chunks,
            "later_chunks": later.chunks if later is not None else 0,
        }


def _answer(emit: Emit) -> Emit:
    """The lanes' emit: a chunk whose decode failed is answered with its error."""

    def answer(request_id: str, output, finish_reason: str | None, error: OmniError | None) -> None:
        if output is not None and output.error is not None:
            output, finish_reason, error = None, None, output.error
        emit(request_id, output, finish_reason, error)

    return answer
