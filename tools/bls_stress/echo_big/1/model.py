# Stands in for a stage (code2wav): answers each request from a worker thread with an audio-sized tensor
# and the request's state tensor back (one response + final), on the device the driver chose. With
# BLS_STRESS_BF16_BYTES=1 its host tensors go out as BF16 views of their bytes, as our stages answer BLS.
import faulthandler
import os
import queue
import threading

import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

faulthandler.enable(all_threads=True)
from omnistage.core.bf16_bytes import to_bf16_bytes

DEVICE = os.environ.get("BLS_STRESS_DEVICE", "cpu")  # cpu, cuda, or mixed: OUT on the host, STATE on cuda
BF16_BYTES = os.environ.get("BLS_STRESS_BF16_BYTES", "0") == "1"
OUT_DEVICE, STATE_DEVICE = ("cpu", "cuda") if DEVICE == "mixed" else (DEVICE, DEVICE)


def tensor(name, t):
    if t.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t))
    if BF16_BYTES:
        return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(to_bf16_bytes(t)))
    return pb_utils.Tensor(name, t.numpy())


class TritonPythonModel:
    def initialize(self, args):
        self.requests = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "IN")
            size = t.shape()[0]
            self.requests.put((r.get_response_sender(), size))
        return None

    def _loop(self):
        while True:
            sender, size = self.requests.get()
            out = torch.ones(4800, device=OUT_DEVICE)
            state = torch.full((size,), 0.5, device=STATE_DEVICE)
            response = pb_utils.InferenceResponse([tensor("OUT", out), tensor("STATE", state)])
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
