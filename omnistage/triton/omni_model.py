# omni_ensemble: the BLS orchestrator users call. execute() only validates parameters and hands each request
# to a thread of its pool (preprocessing and stage streams block); responses go out through a Responder,
# which also notices cancelled requests and aborts their stages.
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from ..core.admission import Admission
from ..core.chunking import ChunkPolicy, ChunkSchedule
from ..core.daemon_pool import DaemonPool
from ..core.errors import BadRequestError, EngineError, OmniError
from ..core.protocol import SAMPLE_RATE
from ..core.request_trace import request_trace
from ..models.checkpoint import load_config
from ..models import media
from ..models.processor import load_processor, prepare_inputs
from ..pipeline.options import OmniOptions
from ..pipeline.prompt_tokens import PromptTokens, check_contexts
from ..pipeline.request import OmniOutput, OmniRequest, thinker_inputs
from .bls import BlsStageClient
from .iterator_reaper import IteratorReaper
from .logs import setup_logging, stop_fault_reports
from .metrics import MetricsPublisher
from .responder import Responder, answer_probe, error_response, send_final
from .stage_model import model_parameters
from .tensors import is_probe, read_string, request_parameters

log = logging.getLogger(__name__)

HANDOFF_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
TTFP_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
# a request's milestones (OmniRequest.timeline), in the order a spoken reply reaches them
MILESTONES = ("preprocessed", "thinker_first_output", "talker_started", "talker_first_frames", "first_chunk_cut",
              "first_audio_sent", "thinker_done", "end")
RTF_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0]


@dataclass
class AudioClock:  # one request's audio timing, for the TTFP and RTF histograms
    start: float
    request_id: str = ""  # the client's (the frontend's) id of the Triton request: the trace's join key
    audio_samples: int = 0
    last_audio: float = 0.0

class OmniModel:
    def initialize(self, args) -> None:
        setup_logging()
        params = model_parameters(args)
        source = params["model_path"]
        self.config = load_config(source)
        self.processor = load_processor(source)
        media.configure(media.MediaLimits.from_parameters(params))
        self.speakers = {k.lower() for k in self.config.talker_config.speaker_id}
        self.prompt_tokens = PromptTokens.from_config(self.config)
        # the stages' contexts as their runners have them (max_seq_len, capped by the checkpoint): a request
        # that cannot fit either is refused before its thinker starts (pipeline/prompt_tokens.py)
        thinker, talker = self.config.thinker_config.text_config, self.config.talker_config.text_config
        self.contexts = (min(int(params.get("max_prompt_tokens", 1024)), thinker.max_position_embeddings),
                         min(int(params.get("talker_max_seq_len", 1024)), talker.max_position_embeddings))
        chunk_frames = int(params.get("chunk_frames", 25))
        light = params.get("light_first_chunk_frames")
        self.chunk_policy = ChunkPolicy(ChunkSchedule(int(params.get("first_chunk_frames", 4)), chunk_frames),
                                        ChunkSchedule(int(light), chunk_frames) if light else None,
                                        int(params.get("light_load_requests", 1)))  # fmt: skip
        # a session's stage calls all go to one replica; new sessions to the least loaded (pipeline/replicas.py)
        # finished stage streams wait here until the Responder's next cancellation query (iterator_reaper.py)
        self.reaper = IteratorReaper()
        replicas = {s: params[f"{s}_models"].split(",") for s in ("thinker", "talker", "code2wav")
                    if params.get(f"{s}_models")}
        self.stages = BlsStageClient(self.reaper, replicas)
        # At most max_inflight requests run: each holds up to ~3 of the server's Python-backend BLS threads
        # (--backend-config=python,thread-pool-size), and running out of them deadlocks every request at
        # once. Up to max_queue more wait for a turn, each for at most max_queue_seconds; beyond either a
        # request is refused (503, retryable) instead of waiting without bound.
        self.admission = Admission("omni_ensemble", int(params.get("max_inflight", 128)),
                                   int(params.get("max_queue", 256)),
                                   float(params.get("max_queue_seconds", 60)))  # fmt: skip
        self.requests: dict[str, OmniRequest] = {}
        # every request's threads (its own, its talker's and its Code2Wav's), reused: execute() never waits for
        # a thread to start, which under this process's busy GIL held up the requests queued behind it
        self.threads = DaemonPool("omni")
        self.left_while_queued: set[str] = set()  # cancelled before their OmniRequest existed
        self.clocks: dict[str, AudioClock] = {}
        # per-request timeline for perf/trace_join.py, when OMNI_TRACE_DIR is set (core/request_trace.py)
        self.trace = request_trace("omni_ensemble")
        self.responder = Responder("omni_ensemble", self.encode, self._cancel, self.reaper)
        self.responder.start()
        self.metrics = (
            MetricsPublisher("omni_ensemble", args.get("model_instance_name", "omni_ensemble"), self._sample)
            .gauge("omni_requests_in_flight", "requests accepted and not yet finished (queued ones included)")
            .gauge("omni_requests_queued", "accepted requests waiting for a turn (admission: max_queue)")
            .counter("omni_requests_refused_total", "requests refused as overloaded (503)")
            .counter("omni_ensemble_response_send_seconds_total", "seconds the response thread spent in Triton's send()")
            .counter("omni_ensemble_response_poll_seconds_total", "seconds the response thread spent asking whether "
                     "clients left (is_cancelled())")
            .counter("omni_ensemble_responses_total", "responses sent")
            .counter("omni_ensemble_response_delay_seconds_total", "summed seconds from an output's hand-over to the "
                     "response thread to its response sent (/ responses_total: the mean wait there)")
            .gauge("omni_replica_sessions", "sessions pinned to each thinker / talker / code2wav replica",
                   [{"stage": s, "replica": r} for s, router in self.stages.routers.items() for r in router.replicas])
            .histogram("omni_handoff_latency_seconds", "round trip of one stage handoff: a talker append "
                       "(thinker rows in) or a Code2Wav chunk (codes in, audio out)", HANDOFF_BUCKETS,
                       [{"hop": "talker_append"}, {"hop": "code2wav"}])
            .histogram("omni_audio_ttfp_seconds", "request arrival to its first audio chunk", TTFP_BUCKETS)
            .histogram("omni_milestone_seconds", "request arrival to each milestone of a finished request "
                       "(usage timeline_ms): where the time to first audio goes", TTFP_BUCKETS,
                       [{"milestone": m} for m in MILESTONES])
            .histogram("omni_audio_rtf", "real-time factor: arrival to last audio chunk over the audio's "
                       "duration (< 1: faster than it plays)", RTF_BUCKETS)
        )  # fmt: skip
        self.metrics.start()

    def execute(self, requests):
        arrival = time.perf_counter()  # the batch's, not after the requests handled before each one
        for request in requests:
            sender = request.get_response_sender()
            if is_probe(request):
                answer_probe(sender, self.responder)
                continue
            try:
                messages = self._messages(request)
                options = OmniOptions.from_parameters(request_parameters(request), self.speakers)
                self.admission.admit()
            except Exception as e:
                send_final(sender, error_response(e if isinstance(e, OmniError) else BadRequestError(str(e))))
                continue
            session = uuid.uuid4().hex
            self.clocks[session] = AudioClock(arrival, request.request_id())
            self.responder.register(session, sender)
            self.threads.submit(self._serve, session, messages, options)
        return None

    def _serve(self, session: str, messages: list, options: OmniOptions) -> None:
        try:
            self._serve_request(session, messages, options)
        except OmniError as e:  # e.g. no turn within max_queue_seconds: the request's own error
            self._emit(session, None, None, e)
        except Exception as e:  # a bug here must still end the request's stream (nobody reads the pool's Future)
            log.exception("[omni_ensemble] request %s failed", session)
            self._emit(session, None, None, EngineError(f"omni_ensemble failed: {e}"))

    def _serve_request(self, session: str, messages: list, options: OmniOptions) -> None:
        emit = lambda output, reason, error: self._emit(session, output, reason, error)  # noqa: E731
        # preprocessing (audio features, image patches) runs inside the turn too: that bounds its memory
        with self.admission.turn():
            try:
                inputs = thinker_inputs(prepare_inputs(self.processor, messages, options.use_audio_in_video))
                check_contexts(inputs["input_ids"], options, *self.contexts, self.prompt_tokens)
            except OmniError as e:
                emit(None, None, e)
                return
            except Exception as e:
                emit(None, None, BadRequestError(f"could not process the messages: {e}"))
                return
            on_hop = lambda hop, seconds: self.metrics.observe("omni_handoff_latency_seconds", seconds, hop=hop)  # noqa: E731
            # the requests in flight (queued ones too), this one counted, choose its chunk schedule
            schedule = self.chunk_policy.for_load(len(self.clocks), options.playback)
            request = OmniRequest(session, inputs, options, self.stages, self.processor.tokenizer, schedule, emit,
                                  on_hop, arrival=self.clocks[session].start, threads=self.threads,
                                  prompt_tokens=self.prompt_tokens)  # fmt: skip
            self.requests[session] = request  # from here on _cancel() reaches it
            if session in self.left_while_queued:  # the client left while it was queued
                emit(None, "abort", None)
                return
            try:
                request.run()
            finally:
                self.stages.release(session)

    def _emit(self, session: str, output, reason, error) -> None:
        clock = self.clocks.get(session)
        if output is not None and output.usage is not None and reason is not None:  # a finished request's
            output.usage["replicas"] = self.stages.placement(session)
            for milestone, ms in output.usage.get("timeline_ms", {}).items():
                if milestone in MILESTONES:
                    self.metrics.observe("omni_milestone_seconds", ms / 1e3, milestone=milestone)
        if clock is not None and output is not None and output.audio is not None and output.audio.numel():
            if clock.audio_samples == 0:
                self.metrics.observe("omni_audio_ttfp_seconds", time.perf_counter() - clock.start)
            clock.audio_samples += output.audio.numel()
            clock.last_audio = time.perf_counter()
        if reason is not None or error is not None:
            self.requests.pop(session, None)
            self.left_while_queued.discard(session)
            self.clocks.pop(session, None)
            if clock is not None and clock.audio_samples and error is None and reason != "abort":
                self.metrics.observe("omni_audio_rtf", (clock.last_audio - clock.start) / (clock.audio_samples / SAMPLE_RATE))
            if self.trace is not None and clock is not None:
                usage = output.usage if output is not None and output.usage else {}
                self.trace.write({"id": clock.request_id, "arrival": clock.start,
                                  "timeline_ms": usage.get("timeline_ms")})  # fmt: skip
        self.responder.emit(session, output, reason, error)

    @staticmethod
    def _messages(request) -> list:
        raw = read_string(request, "messages")
        if raw is None:
            raise BadRequestError("input 'messages' is required")
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BadRequestError(f"messages is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("messages must be a non-empty JSON list")
        return messages

    def encode(self, output: OmniOutput | None, finish_reason: str | None) -> dict:
        values = {}
        if output is not None:
            if output.text or output.token_ids:
                values["text"] = output.text
                values["token_ids"] = torch.tensor(output.token_ids, dtype=torch.int64)
            if output.audio is not None:
                values["audio"] = output.audio
            if output.usage is not None:
                values["usage"] = json.dumps(output.usage)
        if finish_reason is not None:
            values["finish_reason"] = finish_reason
        return values

    def _cancel(self, session: str) -> None:
        request = self.requests.get(session)
        if request is None:  # still waiting for its turn; _serve() ends it when the turn comes
            self.left_while_queued.add(session)
            request = self.requests.get(session)  # unless _serve() registered it in between
            if request is None:
                return
        log.info("[omni_ensemble] request %s cancelled by the client", session)
        request.cancel()

    def _sample(self):
        sessions = [("omni_replica_sessions", {"stage": stage, "replica": replica}, n)
                    for stage, router in self.stages.routers.items() for replica, n in router.load().items()]  # fmt: skip
        admission = [("omni_requests_queued", {}, self.admission.waiting), ("omni_requests_refused_total", {}, self.admission.rejected)]
        responder = [("omni_ensemble_response_send_seconds_total", {}, self.responder.send_seconds),
                     ("omni_ensemble_response_poll_seconds_total", {}, self.responder.poll_seconds),
                     ("omni_ensemble_responses_total", {}, self.responder.responses_sent),
                     ("omni_ensemble_response_delay_seconds_total", {}, self.responder.delay_seconds)]  # fmt: skip
        return [("omni_requests_in_flight", {}, len(self.clocks))] + admission + sessions + responder

    def finalize(self) -> None:
        self.metrics.stop()
        for request in list(self.requests.values()):
            request.cancel()
        self.responder.stop()
        stop_fault_reports()
