# Small host values (slot indices, token histories, banned ids) onto the device without a stream sync.
# torch.tensor(values, device=cuda) and a plain .to(cuda) synchronise the stream after the copy: the host
# waits for every kernel queued before it. Several of those per engine step stall the launch pipeline,
# and on a GPU shared by the stage processes each stall also hands the GPU to another process for a time
# slice. non_blocking=True leaves the ordering to the stream (the copy runs before later kernels), which
# is all these values need; torch keeps a pageable source valid until the copy has been staged.
from __future__ import annotations

import torch


def to_device(values, device: torch.device) -> torch.Tensor:
    """A list (or CPU tensor) as a tensor on `device`, copied without waiting for the device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    return host.to(device, non_blocking=True)
