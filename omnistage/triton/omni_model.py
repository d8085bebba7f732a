# omni_ensemble: the BLS orchestrator users call. execute() only validates parameters and starts a thread
# per request (preprocessing and stage streams block); responses go out through a Responder, which also
# notices cancelled requests and aborts their stages.
from __future__ import annotations

import json
import logging
import threading
import uuid

import torch

from ..core.chunking import ChunkSchedule
from ..core.errors import BadRequestError, OmniError
from ..models.checkpoint import load_config
from ..models.processor import load_processor, prepare_inputs
from ..pipeline.options import OmniOptions
from ..pipeline.request import OmniOutput, OmniRequest, thinker_inputs
from .bls import BlsStageClient
from .logs import setup_logging
from .responder import Responder, error_response, send_final
from .stage_model import model_parameters
from .tensors import output_tensors, read_string, request_parameters

log = logging.getLogger(__name__)

class OmniModel:
    def initialize(self, args) -> None:
        setup_logging()
        params = model_parameters(args)
        source = params["model_path"]
        self.config = load_config(source)
        self.processor = load_processor(source)
        self.speakers = {k.lower() for k in self.config.talker_config.speaker_id}
        self.schedule = ChunkSchedule(int(params.get("first_chunk_frames", 4)), int(params.get("chunk_frames", 25)))
        # a session's stage calls all go to one replica; new sessions to the least loaded (pipeline/replicas.py)
        self.stages = BlsStageClient({s: params[f"{s}_models"].split(",") for s in ("thinker", "talker")
                                      if params.get(f"{s}_models")})  # fmt: skip
        # Requests beyond this wait here before opening any BLS stream: each served request holds up to
        # ~3 of the server's Python-backend BLS threads (--backend-config=python,thread-pool-size), and
        # running out of them deadlocks every request at once instead of queueing the newest.
        self.slots = threading.BoundedSemaphore(int(params.get("max_inflight", 128)))
        self.requests: dict[str, OmniRequest] = {}
        self.responder = Responder("omni_ensemble", self.encode, self._cancel)
        self.responder.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                messages = self._messages(request)
                options = OmniOptions.from_parameters(request_parameters(request), self.speakers)
            except Exception as e:
                send_final(sender, error_response(e if isinstance(e, OmniError) else BadRequestError(str(e))))
                continue
            session = uuid.uuid4().hex
            self.responder.register(session, sender)
            threading.Thread(target=self._serve, args=(session, messages, options), daemon=True,
                             name=f"omni-{session[:8]}").start()  # fmt: skip
        return None

    def _serve(self, session: str, messages: list, options: OmniOptions) -> None:
        emit = lambda output, reason, error: self._emit(session, output, reason, error)  # noqa: E731
        try:
            inputs = thinker_inputs(prepare_inputs(self.processor, messages))
        except OmniError as e:
            emit(None, None, e)
            return
        except Exception as e:
            emit(None, None, BadRequestError(f"could not process the messages: {e}"))
            return
        request = OmniRequest(session, inputs, options, self.stages, self.processor.tokenizer, self.schedule, emit)
        self.requests[session] = request
        with self.slots:
            if request.cancelled.is_set():  # gone while queued
                emit(None, "abort", None)
                return
            try:
                request.run()
            finally:
                self.stages.release(session)

    def _emit(self, session: str, output, reason, error) -> None:
        if output is not None and output.usage is not None:
            output.usage["replicas"] = self.stages.placement(session)
        if reason is not None or error is not None:
            self.requests.pop(session, None)
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

    def encode(self, output: OmniOutput | None, finish_reason: str | None) -> list:
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
        return output_tensors(values)

    def _cancel(self, session: str) -> None:
        request = self.requests.get(session)
        if request is not None:
            log.info("[omni_ensemble] request %s cancelled by the client", session)
            request.cancel()

    def finalize(self) -> None:
        for request in list(self.requests.values()):
            request.cancel()
        self.responder.stop()

