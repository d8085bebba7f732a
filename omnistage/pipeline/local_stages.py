# A StageClient that runs the three stage engines in this process, with the same request/response
# mapping as the Triton models (stages/wire.py). Production goes through Triton BLS (triton/bls.py);
# this one lets tests and tools drive the whole pipeline without a server.
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from ..core.chunking import ChunkSchedule
from ..core.engine import StageEngine
from ..core.errors import EngineError
from ..core.scheduler import Scheduler
from ..stages.code2wav import Code2WavRunner
from ..stages.code2wav_stage import Code2WavStage
from ..stages.talker import TalkerRunner
from ..stages.thinker import ThinkerRunner
from ..stages.wire import (
    talker_defaults,
    talker_response,
    talker_sequence,
    thinker_defaults,
    thinker_response,
    thinker_sequence,
)


class LocalStages:
    def __init__(self, thinker, talker, code2wav, config, *, slots: int = 8, max_seq_len: int = 1024,
                 device="cpu", dtype=torch.float32):  # fmt: skip
        self.max_seq_len = max_seq_len
        self.speakers = {k.lower(): v for k, v in config.talker_config.speaker_id.items()}
        self.text_embeddings = thinker.get_input_embeddings().weight  # the talker looks up text rows there
        self._streams: dict[tuple[str, str], queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        kw = dict(max_slots=slots, max_seq_len=max_seq_len, device=device, dtype=dtype)
        self.engines = {
            "thinker": StageEngine("thinker", ThinkerRunner(thinker, config, **kw), Scheduler(slots), self._emit("thinker")),
            "talker": StageEngine("talker", TalkerRunner(talker, config, self.text_embeddings, **kw), Scheduler(slots),
                                  self._emit("talker")),
        }  # fmt: skip
        # first chunks of the default schedule's length take the first lane, as served
        runner = Code2WavRunner(code2wav, torch.device(device), dtype)
        self.code2wav_stage = Code2WavStage(runner, self._emit("code2wav"),
                                            first_chunk_frames=[ChunkSchedule().first_chunk_frames])  # fmt: skip
        for engine in self.engines.values():
            engine.start()
        self.code2wav_stage.start()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.code2wav_stage.stop()

    # ---- StageClient --------------------------------------------------------------------------------------
    def thinker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]:
        seq = thinker_sequence(session, inputs, parameters, thinker_defaults(self.max_seq_len))
        return self._run("thinker", seq, thinker_response)

    def talker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]:
        defaults = talker_defaults(self.max_seq_len)
        seq = talker_sequence(session, inputs, parameters, defaults, self.speakers, self.text_embeddings.shape[0])
        return self._run("talker", seq, talker_response)

    def talker_append(self, session: str, rows: torch.Tensor | None, end: bool) -> None:
        self.engines["talker"].update(session, lambda seq: seq.payload.append(rows, end))

    def abort(self, stage: str, session: str) -> None:
        (self.code2wav_stage if stage == "code2wav" else self.engines[stage]).abort(session)

    def code2wav(self, session: str, codes: torch.Tensor | None, start: bool, end: bool) -> torch.Tensor:
        stream: queue.SimpleQueue = queue.SimpleQueue()
        key = ("code2wav", session)
        with self._lock:
            self._streams[key] = stream
        try:
            self.code2wav_stage.submit(session, codes, start=start, end=end)
            output, _, error = stream.get()
        finally:
            with self._lock:
                self._streams.pop(key, None)
        if error is not None:
            raise error
        if output is None:
            raise EngineError("code2wav returned no audio")
        return torch.zeros(0) if output.audio is None else output.audio.clone()  # an end with no frames

    # ---- internals ----------------------------------------------------------------------------------------
    def _emit(self, stage: str):
        def emit(request_id, output, finish_reason, error):
            with self._lock:
                stream = self._streams.get((stage, request_id))
            if stream is not None:
                stream.put((output, finish_reason, error))

        return emit

    def _run(self, stage: str, seq, encode) -> Iterator[dict]:
        stream: queue.SimpleQueue = queue.SimpleQueue()
        key = (stage, seq.request_id)
        with self._lock:
            self._streams[key] = stream
        try:
            self.engines[stage].add(seq)
        except Exception:
            with self._lock:
                self._streams.pop(key, None)
            raise
        return self._read(key, stream, encode)

    def _read(self, key, stream: queue.SimpleQueue, encode) -> Iterator[dict]:
        try:
            while True:
                output, finish_reason, error = stream.get()
                if error is not None:
                    raise error
                out = encode(output, finish_reason)
                if out:
                    yield out
                if finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._streams.pop(key, None)
