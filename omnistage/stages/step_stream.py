# A CUDA stream for work that must not queue behind another thread's kernels: Code2Wav's first lane decodes
# new streams' first chunks on a high-priority stream of its own while its main lane's forwards run on
# the default stream.
#
# The price is ordering by hand: run() may first wait for what other threads queued on the default stream
# (inputs copied there), and what it queued is complete when it returns (Triton reads response tensors on
# the default stream). Off CUDA, or disabled, run() leaves the caller on its own stream.
from __future__ import annotations

import contextlib

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
