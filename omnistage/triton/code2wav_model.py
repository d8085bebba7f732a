# Triton glue of the code2wav stage. Each request is one chunk of a stream: its new codec frames plus the
# state the stream's previous chunk returned. The model keeps no per-stream state, so whatever chunks have
# queued (from any number of streams) are decoded together. Triton 2.51 hands a max_batch_size-0 Python
# model one request per execute(), so the batching happens here: execute() only enqueues, and a worker
# thread takes the queued chunks of one shape (one forward) at a time, decodes them and sends.
# New streams' first chunks (what a time to first audio waits for) have a worker of their own, the first
# lane: on CUDA it runs on a high-priority stream and replays CUDA graphs (stages/code2wav_first.py), so a
# first chunk no longer waits behind a forward of later chunks (~100 ms at 64 streams on the H200).
# On CUDA the main worker decodes a group of at most LATER_CHUNK_BATCH chunks with carried state of up to
# chunk_frames frames as one forward, padded to static shapes and replayed as a CUDA graph
# (stages/code2wav_later.py); larger groups (and every group on the CPU) run eager, one forward per shape.
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, NamedTuple

import triton_python_backend_utils as pb_utils

from ..core.errors import BadRequestError, OmniError
from ..core.protocol import CODE2WAV, PAST_FRAMES
from ..models import fused
from ..models.checkpoint import load_stage
from ..stages.code2wav import Code2WavRunner, chunk_key, state_from_tensors, state_to_tensors, take_group
from ..stages.code2wav_first import FirstChunkDecoder
from ..stages.code2wav_later import LaterChunkDecoder
from ..stages.host_copy import sync_current_stream, to_host
from ..stages.step_stream import StepStream
from .logs import stop_fault_reports
from .metrics import MetricsPublisher
from .responder import error_response, send_final
from .stage_model import init_instance
from .tensors import input_tensors, is_probe, output_tensors, request_parameters, wants_bf16_bytes

log = logging.getLogger(__name__)

# a lone stream's eager 25-frame chunk takes ~28 ms of launches for a few ms of kernels, and its last chunk is
# on the way to the end of the reply; groups of up to 4 replay a graph (at 64 streams few groups are that
# small). Measured on the H200: perf/README.md
LATER_CHUNK_BATCH = 4


class PendingChunk(NamedTuple):
    chunk: tuple  # (codes on the device, the stream's state or None)
    sender: Any
    bf16_bytes: bool  # an omni_ensemble BLS call: host tensors go back as BF16 byte views (tensors.py)
    arrived: float  # perf_counter() at execute()


class Code2WavModel:
    def initialize(self, args) -> None:
        params, self.device, dtype = init_instance(args)
        module = load_stage(params["model_path"], "code2wav", dtype, self.device)
        if self.device.type == "cuda":
            log.info("[code2wav] fused kernels installed: %s", fused.install(module))
        context = int(params["left_context_frames"]) if params.get("left_context_frames") else None
        self.runner = Code2WavRunner(module, self.device, dtype, context_frames=context)
        if context is not None and context < self.runner.conv_reach:
            # the chunks would no longer join into the full decode: refuse rather than serve worse audio
            raise ValueError(f"left_context_frames {context} is below this checkpoint's conv reach "
                             f"({self.runner.conv_reach} frames); use null or >= {self.runner.conv_reach}")
        self.max_batch = int(params.get("max_batch_windows", 64))
        self.step_stream = StepStream(self.device, enabled=False)  # the main worker: the caller's stream
        # audio and state leave in pinned host memory, one sync per decoded group (stages/host_copy.py)
        self.host_outputs = self.device.type == "cuda"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # the first lane: first chunks of the schedule's lengths (first_chunk_frames, from the profile's chunks)
        lengths = sorted({int(n) for n in params.get("first_chunk_frames", "").split(",") if n.strip()} - {0})  # 0: off
        cuda = self.device.type == "cuda"
        self.first_decoders = [FirstChunkDecoder(self.runner, n, self.max_batch, cuda_graphs=cuda)
                               for n in lengths]  # fmt: skip
        for decoder in self.first_decoders:
            decoder.capture_all()
        # later chunks (with carried state) in groups of at most LATER_CHUNK_BATCH: static shapes, CUDA graphs
        later_batch = LATER_CHUNK_BATCH if cuda else 0
        self.later = (LaterChunkDecoder(self.runner, int(params.get("chunk_frames", 25)), later_batch,
                                        cuda_graphs=cuda) if later_batch else None)  # fmt: skip
        if self.later is not None:
            self.later.capture_all()
        # its inputs are host tensors or complete CUDA copies (the Python backend copies synchronously), so it
        # does not wait for the default stream, where the other worker's forwards may run
        self.first_stream = StepStream(self.device, True, priority=-1, wait_default=False)
        self._first_queue: queue.SimpleQueue = queue.SimpleQueue()
        # written by the workers, read by the metrics thread
        self._stats_lock = threading.Lock()
        self.last_batch, self.chunks, self.batches, self.busy_seconds = 0, 0, 0, 0.0
        self.first_lane_seconds, self.first_chunks, self.first_chunk_seconds = 0.0, 0, 0.0
        self.metrics = (MetricsPublisher("code2wav", args.get("model_instance_name", "code2wav"), self._sample)
                        .gauge("omni_code2wav_queue_depth", "chunks waiting for a decode")
                        .gauge("omni_code2wav_batch_size", "chunks in the last decode")
                        .counter("omni_code2wav_chunks_total", "chunks decoded")
                        .counter("omni_code2wav_batches_total", "decodes run")
                        .counter("omni_code2wav_forwards_total", "forwards run (one per chunk shape in a decode)")
                        .counter("omni_code2wav_busy_seconds_total", "seconds spent decoding and sending (both workers)")
                        .counter("omni_code2wav_first_lane_seconds_total", "of which the first lane's (new streams' "
                                 "first chunks)")
                        .counter("omni_code2wav_first_chunks_total", "first chunks answered by the first lane")
                        .counter("omni_code2wav_first_chunk_seconds_total", "their seconds from execute() to the "
                                 "response sent")
                        .counter("omni_code2wav_later_chunks_total", "chunks with carried state decoded padded to "
                                 "static shapes (CUDA graphs)"))  # fmt: skip
        self.metrics.start()
        self._workers = [threading.Thread(target=self._loop, args=(self._queue, self.step_stream, False),
                                          name="code2wav-worker", daemon=True)]  # fmt: skip
        if self.first_decoders:
            self._workers.append(threading.Thread(target=self._loop, args=(self._first_queue, self.first_stream, True),
                                                  name="code2wav-first", daemon=True))  # fmt: skip
        for worker in self._workers:
            worker.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if is_probe(request):
                send_final(sender)
                continue
            try:
                inputs = input_tensors(request, CODE2WAV)
                if "codes" not in inputs:
                    raise BadRequestError("codes is required")
                state = state_from_tensors(inputs) if PAST_FRAMES in inputs else None
                # Host-side checks only: anything that touches the device here (a copy, a value check) would
                # wait for the decode in flight, and execute() calls come one at a time, so every chunk
                # would queue behind a whole decode and batches would stay small. The worker does the rest.
                self.runner.check(inputs["codes"], state)
                pending = PendingChunk((inputs["codes"], state), sender, wants_bf16_bytes(request_parameters(request)),
                                       time.perf_counter())  # fmt: skip
                first = self.first_decoders and any(d.fits([pending.chunk]) for d in self.first_decoders)
                (self._first_queue if first else self._queue).put(pending)
            except Exception as e:
                send_final(sender, error_response(e if isinstance(e, OmniError) else BadRequestError(str(e))))
        return None

    def _loop(self, chunks: queue.SimpleQueue, stream: StepStream, first_lane: bool) -> None:
        pending: list[PendingChunk] = []
        while True:
            # One forward's group at a time, from what has queued so far: a stream's first chunk (the time
            # to its first audio) waits for at most the forward in flight, not for a whole batch of shapes.
            if not pending:
                pending.append(chunks.get())
            while True:
                try:
                    pending.append(chunks.get_nowait())
                except queue.Empty:
                    break
            if any(item is None for item in pending):
                return
            group, pending = take_group(pending, self._group_key, self.max_batch)
            group = self._turn_away_bad_ranges(group)
            if group:
                self._decode(group, stream, first_lane)

    def _group_key(self, pending: PendingChunk) -> tuple:
        """The lowest key decodes first: new streams' chunks by shape, then all chunks the later decoder
        takes (one group), then other chunks by shape."""
        if self.later is not None and self.later.fits([pending.chunk]):
            return (1,)
        return (0 if pending.chunk[1] is None else 2, *chunk_key(*pending.chunk))

    def _groups(self, chunks: list, first_lane: bool):
        """decode_groups(), or the first lane's decoder for first chunks of its length, or the later
        decoder for its chunks (one group each)."""
        if first_lane:
            decoder = next((d for d in self.first_decoders if d.fits(chunks)), None)
        else:
            # a larger group runs eager, by shape: there the conv stack's work, not its launches, bounds a
            # forward, and padded rows would be paid in full (perf/README.md, 2026-12-04 fifth session)
            later = self.later
            decoder = later if later is not None and len(chunks) <= later.max_batch and later.fits(chunks) else None
        if decoder is None:  # ranges were checked by _turn_away_bad_ranges: no second device sync for them
            return self.runner.decode_groups(chunks, check_ranges=False)
        return [list(enumerate(decoder.decode(chunks)))]

    def _decode(self, batch: list[PendingChunk], stream: StepStream, first_lane: bool) -> None:
        """Decodes chunks of one shape (one forward) and answers each."""
        t0 = time.perf_counter()
        answered: set[int] = set()
        try:
            with stream.run():
                for done in self._groups([p.chunk for p in batch], first_lane):
                    values = [(i, {"audio": wav.float(), **state_to_tensors(state)}) for i, (wav, state) in done]
                    if self.host_outputs:  # queued behind the forward, complete at one sync for the group
                        values = [(i, {k: to_host(v) for k, v in d.items()}) for i, d in values]
                        sync_current_stream(self.device)
                    else:
                        stream.sync()  # Triton copies the tensors on the default stream
                    responses = [(i, output_tensors(d, batch[i].bf16_bytes)) for i, d in values]
                    self._send(batch, responses, answered)
        except Exception as e:
            log.exception("[code2wav] decode failed")
            for i, p in enumerate(batch):
                if i not in answered:
                    send_final(p.sender, error_response(e if isinstance(e, OmniError) else OmniError(str(e))))
        done = time.perf_counter()
        with self._stats_lock:
            self.last_batch, self.chunks, self.batches = len(batch), self.chunks + len(batch), self.batches + 1
            self.busy_seconds += done - t0
            if first_lane:
                self.first_lane_seconds += done - t0
                self.first_chunks += len(batch)
                self.first_chunk_seconds += sum(done - p.arrived for p in batch)

    @staticmethod
    def _send(batch: list[PendingChunk], responses, answered: set[int]) -> None:
        for i, tensors in responses:
            send_final(batch[i].sender, pb_utils.InferenceResponse(output_tensors=tensors))
            answered.add(i)

    def _turn_away_bad_ranges(self, batch: list[PendingChunk]) -> list[PendingChunk]:
        try:
            errors = self.runner.range_errors([p.chunk[0] for p in batch])
        except Exception as e:  # e.g. codes on a device this instance cannot read
            errors = [f"could not read the codes: {e}"] * len(batch)
        for p, error in zip(batch, errors):
            if error is not None:
                send_final(p.sender, error_response(BadRequestError(error)))
        return [p for p, error in zip(batch, errors) if error is None]

    def _sample(self):
        queued = self._queue.qsize() + self._first_queue.qsize()
        return [("omni_code2wav_queue_depth", {}, queued), ("omni_code2wav_batch_size", {}, self.last_batch),
                ("omni_code2wav_chunks_total", {}, self.chunks), ("omni_code2wav_batches_total", {}, self.batches),
                ("omni_code2wav_forwards_total", {}, self.runner.forwards),
                ("omni_code2wav_busy_seconds_total", {}, self.busy_seconds),
                ("omni_code2wav_first_lane_seconds_total", {}, self.first_lane_seconds),
                ("omni_code2wav_first_chunks_total", {}, self.first_chunks),
                ("omni_code2wav_first_chunk_seconds_total", {}, self.first_chunk_seconds),
                ("omni_code2wav_later_chunks_total", {}, self.later.chunks if self.later is not None else 0)]  # fmt: skip

    def finalize(self) -> None:
        self.metrics.stop()
        self._queue.put(None)
        self._first_queue.put(None)
        stop_fault_reports()
