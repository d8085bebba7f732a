# Triton glue of the code2wav stage. Stateless per window, so Triton's dynamic batcher hands several
# queued windows (from many requests) to one execute() call and they are decoded together. Responses
# go out from a sender thread, so the next batch can start while this one's results are being sent.
from __future__ import annotations

import logging
import queue
import threading

import torch
import triton_python_backend_utils as pb_utils

from ..core.errors import BadRequestError, OmniError
from ..models.checkpoint import load_stage
from ..stages.code2wav import Code2WavRunner
from .responder import error_response, send_final
from .stage_model import instance_device, model_parameters, stage_dtype
from .tensors import from_torch, input_tensor

log = logging.getLogger(__name__)


class Code2WavModel:
    def initialize(self, args) -> None:
        params = model_parameters(args)
        self.device = instance_device(args, params)
        dtype = stage_dtype(params, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        module = load_stage(params["model_path"], "code2wav", dtype, self.device)
        self.runner = Code2WavRunner(module, self.device, dtype)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="code2wav-sender", daemon=True)
        self._sender.start()

    def execute(self, requests):
        windows, senders = [], []
        for request in requests:
            sender = request.get_response_sender()
            try:
                codes = input_tensor(request, "codes")
                context = input_tensor(request, "context_frames")
                if codes is None or context is None:
                    raise BadRequestError("codes and context_frames are required")
                windows.append((codes.to(self.device).long(), int(context.reshape(-1)[0])))
                senders.append(sender)
            except Exception as e:
                self._outbox.put((sender, error_response(e if isinstance(e, OmniError) else BadRequestError(str(e)))))
        if windows:
            try:
                wavs = self.runner.decode(windows)
                for sender, wav in zip(senders, wavs):
                    response = pb_utils.InferenceResponse(output_tensors=[from_torch("audio", wav.float())])
                    self._outbox.put((sender, response))
            except OmniError as e:
                for sender in senders:
                    self._outbox.put((sender, error_response(e)))
            except Exception as e:
                log.exception("[code2wav] decode failed")
                for sender in senders:
                    self._outbox.put((sender, error_response(e)))
        return None

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            sender, response = item
            send_final(sender, response)

    def finalize(self) -> None:
        self._outbox.put(None)
