# Shaped like omni_ensemble: a thread per request calls echo_big CALLS times in a row, each time with the
# state tensor the last call returned (as code2wav's stream state travels); a responder thread sends each
# chunk to the client and polls is_cancelled() of every open request.
import faulthandler
import os
import queue
import sys
import threading
import time
import traceback
import weakref

import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

from omnistage.core.bf16_bytes import from_bf16_bytes
from omnistage.triton.iterator_reaper import IteratorReaper

faulthandler.enable(all_threads=True)
DEVICE = os.environ.get("BLS_STRESS_DEVICE", "cpu")
STATE_DEVICE = "cuda" if DEVICE == "mixed" else DEVICE  # mixed: echo_big answers with a host and a GPU tensor
STATE = int(os.environ.get("BLS_STRESS_STATE", 1_200_000))  # floats: code2wav's full-size past_kv
CALLS = int(os.environ.get("BLS_STRESS_CALLS", 6))
POLL = os.environ.get("BLS_STRESS_POLL", "1") == "1"
# EARLY=1: leave each call at its first response, dropping the iterator before its end (a caller that reads
# only the first response of a stream)
EARLY = os.environ.get("BLS_STRESS_EARLY", "0") == "1"
# VIEWS=1: keep what a response carries as DLPack views of its memory, the state until the next call
# replaces it, instead of copies (omni_ensemble copies: a view's release escapes the iterator reaper)
VIEWS = os.environ.get("BLS_STRESS_VIEWS", "0") == "1"


def tensor(name, t):
    if t.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t))
    return pb_utils.Tensor(name, t.numpy())


BF16_BYTES = os.environ.get("BLS_STRESS_BF16_BYTES", "0") == "1"
# FREE_PROBE=1: a weakref finalizer on the numpy array of every host tensor received. Python runs it where
# the array is freed; a thread without a Python thread state cannot run it and segfaults at once. So a
# fault with this on proves the stub frees response arrays off the GIL (it does: triton/iterator_reaper.py).
FREE_PROBE = os.environ.get("BLS_STRESS_FREE_PROBE", "0") == "1"


# REAPER=1: each finished iterator is held until the responder thread's next is_cancelled() round trip,
# as omni_ensemble does (omnistage/triton/iterator_reaper.py): with it, the probe above never faults.
REAPER = IteratorReaper() if os.environ.get("BLS_STRESS_REAPER", "0") == "1" else None


PROBE = {"watched": 0, "freed": 0}  # the probe's counts, printed to the server log as the run goes


def _freed() -> None:
    PROBE["freed"] += 1


def to_torch(t):
    if not t.is_cpu():
        return dlpack.from_dlpack(t.to_dlpack())
    if BF16_BYTES:
        return from_bf16_bytes(dlpack.from_dlpack(t.to_dlpack()), "TYPE_FP32")
    return torch.from_numpy(t.as_numpy())


class TritonPythonModel:
    def initialize(self, args):
        self.chunks = queue.SimpleQueue()
        self.senders = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._respond, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            sid = os.urandom(8).hex()
            with self.lock:
                self.senders[sid] = r.get_response_sender()
            threading.Thread(target=self._serve, args=(sid,), daemon=True).start()
        return None

    def _serve(self, sid):
        try:
            state = torch.zeros(STATE, device=STATE_DEVICE)
            for _ in range(CALLS):
                request = pb_utils.InferenceRequest(
                    model_name="echo_big", inputs=[tensor("IN", state)], requested_output_names=["OUT", "STATE"]
                )
                responses = request.exec(decoupled=True)
                for response in responses:
                    if response.has_error():
                        raise RuntimeError(response.error().message())
                    outs = {t.name(): to_torch(t) if VIEWS else to_torch(t).clone() for t in response.output_tensors()}
                    if FREE_PROBE and not BF16_BYTES:  # BF16 tensors have no numpy array to free
                        for t in response.output_tensors():
                            if t.is_cpu():
                                weakref.finalize(t.as_numpy(), _freed)
                                PROBE["watched"] += 1
                    if outs:
                        state = outs["STATE"]
                        self.chunks.put((sid, outs["OUT"].cpu(), False))
                        if EARLY:
                            break
                if REAPER is not None:
                    REAPER.hold(responses)
                del responses, response
        except Exception:
            traceback.print_exc(file=sys.stderr)
        self.chunks.put((sid, None, True))

    def _respond(self):
        last_poll, last_probe = 0.0, (0, 0)
        while True:
            try:
                items = [self.chunks.get(timeout=0.05)]
            except queue.Empty:
                items = []
            for sid, out, final in items:
                with self.lock:
                    sender = self.senders.pop(sid) if final else self.senders.get(sid)
                if final:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out.numpy())]))
            if POLL and time.monotonic() - last_poll > 0.05:
                last_poll = time.monotonic()
                with self.lock:
                    senders = list(self.senders.values())
                queries = lambda: not all([s.is_cancelled() for s in senders])  # noqa: E731 (one answered False)
                if REAPER is None:
                    queries()
                else:
                    REAPER.barrier(queries)
                if FREE_PROBE and (PROBE["freed"], PROBE["watched"]) != last_probe:
                    last_probe = (PROBE["freed"], PROBE["watched"])
                    print(f"free probe: {last_probe[0]} of {last_probe[1]} arrays freed", file=sys.stderr, flush=True)
