# The CUDA stream a stage's engine steps run on: a stream of its own, not the legacy default stream.
#
# Why: the Python backend copies every CUDA tensor of a response (and of a GPU input) with cudaMemcpy
# followed by cudaStreamSynchronize(0) on the legacy default stream (python_backend's PbMemory::CopyBuffer),
# which waits for all work queued on that stream. With the engine's graphs replayed there too, each response
# carrying a CUDA tensor waited for the step in flight, so a response thread sent about one response per
# engine step: at 64 streams the talker answered each request ~7 times for its 46 frames (26 times on a
# stream of its own). A stream created by torch is non-blocking, so that copy no longer waits for the
# engine. (The thinker's responses stayed at ~2.6 per request on the GPU either way, at ~12 ms per send();
# handing outputs over in host memory instead, handoff "cpu", took that to ~1.3 ms: perf/README.md, third
# session.)
#
# The price is ordering by hand: a step first waits for what other threads queued on the default stream
# (inputs copied there), and its outputs are complete before it returns (the response thread hands them to
# Triton, which reads them on the default stream).
#
# Opt-in (profile key `step_stream`): on the H200 it took a lone request's first audio from 199 to 179 ms
# and let the talker answer every frame, but in 2 of 3 served runs of 320-640 W1 requests at 32-64 streams
# a few requests stalled after their first audio chunk (their thinker text never reached the talker) and
# the cause is not found; perf/README.md, 2026-12-03 second session.
from __future__ import annotations

import contextlib
import functools

import torch


class StepStream:
    """priority: CUDA stream priority (lower runs first; 0 is the default's). wait_default=False: run() does not
    wait for the default stream first, for work whose inputs are already complete."""

    def __init__(self, device: torch.device | str, enabled: bool = True, priority: int = 0, wait_default: bool = True):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device, priority=priority) if enabled and device.type == "cuda" else None
        self.wait_default = wait_default

    @contextlib.contextmanager
    def run(self):
        if self.stream is None:
            yield
            return
        if self.wait_default:
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        self.sync()

    def sync(self) -> None:
        """Waits for everything queued on the stream so far (CUDA tensors made on it are then complete)."""
        if self.stream is not None:
            self.stream.synchronize()


def on_step_stream(method):
    """Runs a runner method (prefill, decode, release) on the runner's `step_stream`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.step_stream.run():
            return method(self, *args, **kwargs)

    return wrapper
