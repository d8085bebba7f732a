# Host values (slot indices, token histories, banned ids, prompt rows) onto the device without a stream
# sync. torch.tensor(values, device=cuda) and a plain .to(cuda) synchronise the stream after the copy: the
# host waits for every kernel queued before it. Several of those per engine step stall the launch pipeline,
# and on a GPU shared by the stage processes each stall also hands the GPU to another process for a time
# slice. An asynchronous copy from pageable memory is no cure either: the driver may synchronise the
# stream to stage it (CUDA's API sync rules), so the values go through pinned memory first. torch's
# caching host allocator keeps a pinned block until the copy that reads it has run. The values are copied
# into a fresh pinned block rather than asking is_pinned() first, a driver query that showed ~0.2 ms per
# call in a profiled talker step.
from __future__ import annotations

import torch


def to_device(values, device: torch.device) -> torch.Tensor:
    """A list or tensor as a tensor on `device`, copied without waiting for the device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if torch.device(device).type == "cuda" and host.device.type == "cpu":
        host = torch.empty_like(host, pin_memory=True).copy_(host)
    return host.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory, queued on the current stream without waiting for it:
    the copy is complete, and the tensor safe to read, once that stream has been synchronised past this
    point (an engine step's own sync: the sampled tokens' .tolist()). Host tensors come back as they are."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def sync_current_stream(device: torch.device) -> None:
    """Waits for the work queued on the device's current stream (copies made by to_host are then complete);
    nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def outputs_to_host(outputs, device: torch.device) -> None:
    """Moves the CUDA tensor fields of dataclass outputs to pinned host memory in place (nested dataclasses
    too), then syncs the device's current stream once if anything was copied."""
    copied = False

    def visit(obj) -> None:
        nonlocal copied
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                setattr(obj, name, to_host(value))
                copied = True
            elif hasattr(value, "__dataclass_fields__"):
                visit(value)

    for output in outputs:
        if output is not None:
            visit(output)
    if copied:
        sync_current_stream(device)
