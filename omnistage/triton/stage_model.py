# Generic decoupled Triton model around a StageEngine (thinker, talker). Three threads, one job each:
# execute() only parses requests and hands them to the engine; the engine thread runs the batch loop;
# the Responder thread sends responses and watches for cancelled requests.
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import replace

import torch

from ..core.engine import StageEngine
from ..core.errors import PROBE_ACTION, BadRequestError, OmniError
from ..core.sampling import SamplingParams
from ..core.scheduler import (ATTENDED_BESIDE_DECODES, MAX_PREFILL_TOKENS, MAX_PREFILLS_PER_STEP,
                              REPLY_RESERVE_TOKENS, Scheduler, Sequence)
from ..models import experts
from ..models.checkpoint import load_config, load_stage, resolve_checkpoint
from ..stages.kv_budget import kv_budget_bytes
from ..stages.long_prefill import PIECE_TOKENS
from .logs import setup_logging, stop_fault_reports
from .metrics import StageMetrics
from .responder import Responder, answer_probe, error_response, send_final
from .tensors import request_parameters, wants_bf16_bytes

log = logging.getLogger(__name__)


def model_parameters(args) -> dict[str, str]:
    """The model's config parameters; a relative model_path is resolved against the repository root."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    if params.get("model_path"):
        params["model_path"] = resolve_checkpoint(params["model_path"])
    return params


def instance_device(args, params: dict[str, str]) -> torch.device:
    if params.get("device", "cpu") == "cuda" or args.get("model_instance_kind") == "GPU":
        return torch.device("cuda", int(args.get("model_instance_device_id", 0)))
    return torch.device("cpu")


def stage_dtype(params: dict[str, str], device: torch.device) -> torch.dtype:
    name = params.get("dtype") or ("bfloat16" if device.type == "cuda" else "float32")
    return getattr(torch, name)


def init_instance(args) -> tuple[dict[str, str], torch.device, torch.dtype]:
    """What every stage instance does first: logging, its parameters, and its device and dtype."""
    setup_logging()
    params = model_parameters(args)
    device = instance_device(args, params)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # A GPU stage's host tensors are small, and torch's intra-op pool (a thread per core) mostly spun: on
        # the H200 host (16 cores) at 64 W1 streams the talker used 53 and Code2Wav 27 cpu-s of a 10 s level,
        # 8 and 6 with one thread (that call: 30.8 -> 37.5 req/s; calls differ by up to ~20%;
        # perf/results/h200-prefix-variants.json)
        torch.set_num_threads(1)
        if params.get("memory_fraction"):  # a deploy profile's share of this GPU for this instance
            torch.cuda.set_per_process_memory_fraction(float(params["memory_fraction"]), device)
    return params, device, stage_dtype(params, device)


class StageModel:
    STAGE = ""  # thinker | talker

    def initialize(self, args) -> None:
        self.params, self.device, self.dtype = init_instance(args)
        source = self.params["model_path"]
        self.config = load_config(source)
        model = load_stage(source, self.STAGE, self.dtype, self.device,
                           experts_implementation=experts.NAME if self.device.type == "cuda" else None)
        self.max_seq_len = int(self.params.get("max_seq_len", 1024))  # context per sequence
        # rows: max_batch_size; the paged KV pool: the KV budget's blocks (stages/kv_budget.py)
        self.max_slots = int(self.params.get("max_batch_size", 8))
        self.kv_cache_bytes = kv_budget_bytes(self.params)
        # on CUDA the decode steps and the static prefills replay as graphs, over the fused kernels the runner
        # installs: both are the measured path there (perf/results/h200-static-prefill.json); the
        # CPU runs eager
        self.cuda_graphs = self.device.type == "cuda"
        self.max_prefills = min(MAX_PREFILLS_PER_STEP, self.max_slots)
        # a deploy profile's sampling defaults, over the stage's built-in ones (validated when rendered)
        self.sampling_overrides = json.loads(self.params.get("sampling_defaults") or "{}")
        runner = self.build_runner(model)
        if runner.fused:
            log.info("[%s] fused kernels installed: %s", self.STAGE, runner.fused)
        # before serving, so that ready means warm: capture needs the device to itself, and the warm-up
        # request loads what the graphs leave out
        runner.capture_graphs()
        runner.warm_up()
        self.responder = Responder(self.STAGE, self.encode, self._cancel)
        self.kv = runner.kv_plan
        scheduler = Scheduler(self.max_slots, self.max_prefills, int(self.params.get("max_queue", 1024)),
                              MAX_PREFILL_TOKENS, blocks=runner.cache.pool,
                              reply_reserve=REPLY_RESERVE_TOKENS if runner.RECOMPUTES else None,
                              attended_beside_decodes=ATTENDED_BESIDE_DECODES, piece_tokens=PIECE_TOKENS)  # fmt: skip
        self.engine = StageEngine(self.STAGE, runner, scheduler, self.responder.emit)
        self.responder.start()
        self.engine.start()
        instance = args.get("model_instance_name", self.STAGE)
        self.metrics = StageMetrics(self.STAGE, instance, self.engine, self.responder, self.kv, self.device)
        self.metrics.start()
        log.info("[%s] ready on %s (%s), %d rows, context %d tokens, KV pool %.1f MiB (%d tokens)", self.STAGE,
                 self.device, self.dtype, self.max_slots, self.max_seq_len, self.kv.cache_bytes / 2**20,
                 self.kv.tokens)  # fmt: skip

    def build_runner(self, model):
        raise NotImplementedError

    def sampling_defaults(self, builtin: SamplingParams) -> SamplingParams:
        overrides = dict(self.sampling_overrides)
        if "stop_token_ids" in overrides:
            overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
        return replace(builtin, **overrides)

    def sequence_from(self, request, params: dict, request_id: str) -> Sequence:
        raise NotImplementedError

    def encode(self, output, finish_reason: str | None) -> dict:
        """The response's values: name -> torch.Tensor or str (the Responder makes the tensors)."""
        raise NotImplementedError

    def execute(self, requests):
        for request in requests:
            self._handle(request, request.get_response_sender())
        return None

    def _handle(self, request, sender) -> None:
        request_id = None
        try:
            params = request_parameters(request)
            action = params.get("action", "start")
            # Triton's own request ids are chosen by clients and may collide; sessions come from our orchestrator
            request_id = str(params.get("session") or uuid.uuid4().hex)
            if action == PROBE_ACTION:
                answer_probe(sender, self.responder)
            elif action == "abort":
                self.engine.abort(request_id)
                send_final(sender)
            elif action == "start":
                seq = self.sequence_from(request, params, request_id)
                # before add: the engine may answer at once
                self.responder.register(request_id, sender, bf16_bytes=wants_bf16_bytes(params))
                if self.validates_aside(seq):
                    self.engine.add_async(seq, lambda e: self._refuse(request_id, sender, e))
                else:
                    self.engine.add(seq)
            else:
                self.control(action, request, params, request_id, sender)
        except Exception as e:  # a malformed request must not take the model down
            self._refuse(request_id, sender, e)

    def _refuse(self, request_id: str | None, sender, e: Exception) -> None:
        if not isinstance(e, OmniError):
            log.error("[%s] bad request", self.STAGE, exc_info=e)
            e = BadRequestError(f"invalid request: {e}")
        if request_id is not None:
            self.responder.unregister(request_id, sender)
        send_final(sender, error_response(e))

    def validates_aside(self, seq: Sequence) -> bool:
        """Whether the engine validates this start on its intake threads (StageEngine.add_async), beside
        the next requests this thread takes in, rather than here."""
        return False

    def control(self, action: str, request, params: dict, request_id: str, sender) -> None:
        raise BadRequestError(f"unknown action {action!r}")

    def _cancel(self, request_id: str) -> None:
        log.info("[%s] request %s cancelled by the client", self.STAGE, request_id)
        self.engine.abort(request_id)

    def finalize(self) -> None:
        self.metrics.stop()
        self.engine.stop()
        self.responder.stop()
        stop_fault_reports()
