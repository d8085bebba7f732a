# Triton glue of the code2wav stage (stages/code2wav_stage.py): execute() only parses each request (one chunk
# of a session, or an abort) and hands it to the stage; the stage's two lanes decode on threads of their own;
# a Responder per lane sends the answers and watches for callers that left, whose sessions it aborts. The
# first lane has its own, so a new stream's first audio never waits behind a round of later chunks' sends.
from __future__ import annotations

import logging
import uuid

from ..core.errors import PROBE_ACTION, BadRequestError, OmniError
from ..core.sampling import coerce_parameter
from ..models import fused
from ..models.checkpoint import load_stage
from ..stages.code2wav import Code2WavRunner
from ..stages.code2wav_stage import Code2WavAudio, Code2WavStage
from .logs import stop_fault_reports
from .metrics import MetricsPublisher
from .responder import Responder, error_response, send_final
from .stage_model import init_instance
from .tensors import input_tensor, request_parameters, wants_bf16_bytes
from .workarounds import CALLER_SILENT_SECONDS

log = logging.getLogger(__name__)


class Code2WavModel:
    def initialize(self, args) -> None:
        params, device, dtype = init_instance(args)
        module = load_stage(params["model_path"], "code2wav", dtype, device)
        if device.type == "cuda":  # the measured path there (perf/results/h200-step-streams.json)
            log.info("[code2wav] fused kernels installed: %s", fused.install(module))
        runner = Code2WavRunner(module, device, dtype)
        self.responders = {lane: Responder(f"code2wav-{lane}", self.encode, self._cancel) for lane in ("first", "main")}
        self.stage = Code2WavStage(
            runner, self.responders["main"].emit, emit_first=self.responders["first"].emit,
            max_batch=int(params.get("max_batch_windows", 64)),
            # the first lane takes first chunks of the schedule's lengths (0 or none: no first lane)
            first_chunk_frames=[int(n) for n in params.get("first_chunk_frames", "").split(",") if n.strip()],
            chunk_frames=int(params.get("chunk_frames", 25)),  # the later chunks' largest size
            session_idle_s=CALLER_SILENT_SECONDS,  # a session whose caller died between chunks (workarounds.py)
        )  # fmt: skip
        for responder in self.responders.values():
            responder.start()
        self.stage.start()
        self.metrics = (MetricsPublisher("code2wav", args.get("model_instance_name", "code2wav"), self._sample)
                        .gauge("omni_code2wav_sessions", "open streams, each with its state resident here")
                        .gauge("omni_code2wav_queue_depth", "chunks waiting for a decode")
                        .gauge("omni_code2wav_batch_size", "chunks in the last decode")
                        .counter("omni_code2wav_chunks_total", "chunks decoded")
                        .counter("omni_code2wav_batches_total", "decodes run")
                        .counter("omni_code2wav_forwards_total", "forwards run (one per chunk shape in a decode)")
                        .counter("omni_code2wav_busy_seconds_total", "seconds spent decoding and sending (both lanes)")
                        .counter("omni_code2wav_first_lane_seconds_total", "of which the first lane's (new streams' "
                                 "first chunks)")
                        .counter("omni_code2wav_first_chunks_total", "first chunks answered by the first lane")
                        .counter("omni_code2wav_first_chunk_seconds_total", "their seconds from execute() to the "
                                 "response sent")
                        .counter("omni_code2wav_main_chunks_total", "chunks answered by the main lane (all but "
                                 "new streams' first chunks)")
                        .counter("omni_code2wav_main_chunk_seconds_total", "their seconds from execute() to the "
                                 "response sent: a caller's round trip less this is the transport's")
                        .counter("omni_code2wav_response_send_seconds_total", "seconds the response threads (both "
                                 "lanes) spent in Triton's send()")
                        .counter("omni_code2wav_response_delay_seconds_total", "summed seconds from a decoded chunk's "
                                 "hand-over to its response thread to its response sent (both lanes)")
                        .counter("omni_code2wav_later_chunks_total", "chunks with carried state decoded padded to "
                                 "static shapes (CUDA graphs)")
                        .counter("omni_code2wav_sessions_expired_total", "sessions closed after "
                                 f"{CALLER_SILENT_SECONDS:.0f}s without a chunk (their caller died)"))  # fmt: skip
        self.metrics.start()

    def execute(self, requests):
        for request in requests:
            self._handle(request, request.get_response_sender())
        return None

    def _handle(self, request, sender) -> None:
        try:
            params = request_parameters(request)
            action = params.get("action", "start")
            if action == PROBE_ACTION:
                send_final(sender)
                return
            if action not in ("start", "append", "abort"):
                raise BadRequestError(f"unknown action {action!r}")
            session = str(params.get("session") or "")
            end = coerce_parameter("end", bool, params.get("end", False))
            if not session and action == "start":  # a stream of one chunk (perf_analyzer's inputs, a test)
                session, end = f"one-chunk-{uuid.uuid4().hex}", True
            elif not session:
                raise BadRequestError("parameter 'session' is required: a stream's chunks share one")
            if action == "abort":
                self.stage.abort(session)
                send_final(sender)
                return
            codes, start = input_tensor(request, "codes"), action == "start"
            responder = self.responders[self.stage.lane(codes, start)]
            responder.register(session, sender, bf16_bytes=wants_bf16_bytes(params))  # before: the answer may be quick
            try:
                self.stage.submit(session, codes, start=start, end=end)
            except Exception:
                responder.unregister(session, sender)
                raise
        except Exception as e:  # a malformed request must not take the model down
            if not isinstance(e, OmniError):
                log.exception("[code2wav] bad request")
                e = BadRequestError(f"invalid request: {e}")
            send_final(sender, error_response(e))

    @staticmethod
    def encode(output: Code2WavAudio | None, finish_reason: str | None) -> dict:
        return {} if output is None or output.audio is None else {"audio": output.audio.float()}

    def _cancel(self, session: str) -> None:
        log.info("[code2wav] session %s cancelled by its caller", session)
        self.stage.abort(session)

    def _sample(self):
        s = self.stage.stats()
        first, main, responders = self.responders["first"], self.responders["main"], self.responders.values()
        sending = sum(r.encode_seconds + r.send_seconds for r in responders)
        return [("omni_code2wav_sessions", {}, s["sessions"]), ("omni_code2wav_queue_depth", {}, s["queued"]),
                ("omni_code2wav_batch_size", {}, s["last_group"]), ("omni_code2wav_chunks_total", {}, s["chunks"]),
                ("omni_code2wav_batches_total", {}, s["groups"]), ("omni_code2wav_forwards_total", {}, s["forwards"]),
                ("omni_code2wav_busy_seconds_total", {}, s["busy_seconds"] + sending),
                ("omni_code2wav_first_lane_seconds_total", {},
                 s["first_lane_seconds"] + first.encode_seconds + first.send_seconds),
                ("omni_code2wav_first_chunks_total", {}, s["first_chunks"]),
                ("omni_code2wav_first_chunk_seconds_total", {}, first.first_response_seconds),
                ("omni_code2wav_main_chunks_total", {}, main.first_responses),
                ("omni_code2wav_main_chunk_seconds_total", {}, main.first_response_seconds),
                ("omni_code2wav_response_send_seconds_total", {}, sum(r.send_seconds for r in responders)),
                ("omni_code2wav_response_delay_seconds_total", {}, sum(r.delay_seconds for r in responders)),
                ("omni_code2wav_later_chunks_total", {}, s["later_chunks"]),
                ("omni_code2wav_sessions_expired_total", {}, s["sessions_expired"])]  # fmt: skip

    def finalize(self) -> None:
        self.metrics.stop()
        self.stage.stop()
        for responder in self.responders.values():
            responder.stop()
        stop_fault_reports()
