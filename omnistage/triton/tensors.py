# Conversions between Triton Python-backend tensors and torch. Stage outputs cross stages in host memory:
# the GPU runners copy them at their steps' own syncs (stages/host_copy.py), since a CUDA tensor in a
# response costs the Python backend a device copy that waits for the step in flight on the default stream.
# Inputs reach a model on the host (the Python backend's default). CPU tensors go through numpy (the 2.51
# stub needs numpy<2 for that path), except in responses to omni_ensemble's BLS calls, where they travel as
# BF16 views of their bytes (core/bf16_bytes.py).
from __future__ import annotations

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

from ..core.bf16_bytes import from_bf16_bytes, to_bf16_bytes
from ..core.errors import PROBE_ACTION
from ..core.protocol import BLS_TRANSPORT, BLS_TRANSPORT_BF16_BYTES


def to_torch(tensor, device: torch.device | None = None) -> torch.Tensor:
    if tensor.is_cpu():
        t = torch.from_numpy(tensor.as_numpy())
    else:
        t = dlpack.from_dlpack(tensor.to_dlpack())
    return t if device is None else t.to(device, non_blocking=True)


def from_torch(name: str, t: torch.Tensor, bf16_bytes: bool = False):
    t = t.contiguous()
    if t.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t))
    if bf16_bytes:
        return bf16_bytes_tensor(name, t)
    return pb_utils.Tensor(name, t.numpy())


def bf16_bytes_tensor(name: str, value: torch.Tensor | str):
    """A host tensor or a string as a BF16 tensor over its bytes (core/bf16_bytes.py), through DLPack."""
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(to_bf16_bytes(value)))


def wants_bf16_bytes(params: dict) -> bool:
    """Whether a request (omni_ensemble's BLS calls) asks for host tensors as BF16 views of their bytes."""
    return params.get(BLS_TRANSPORT) == BLS_TRANSPORT_BF16_BYTES


def bls_output(tensor, data_type: str) -> torch.Tensor | str:
    """A tensor of a BLS response to a bf16_bytes request: GPU tensors as they are, host ones unpacked."""
    t = dlpack.from_dlpack(tensor.to_dlpack())
    return t if t.is_cuda else from_bf16_bytes(t, data_type)


def input_tensor(request, name: str, device: torch.device | None = None) -> torch.Tensor | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else to_torch(t, device)


def input_tensors(request, contract) -> dict[str, torch.Tensor]:
    """Every input of the contract that the request carries, as torch tensors (on their device)."""
    found = {}
    for spec in contract.inputs:
        t = input_tensor(request, spec.name)
        if t is not None:
            found[spec.name] = t
    return found


def output_tensors(values: dict, bf16_bytes: bool = False) -> list:
    """name -> torch.Tensor or str (TYPE_STRING) into response tensors. bf16_bytes: host tensors and strings
    as BF16 views of their bytes, for a BLS caller (see wants_bf16_bytes)."""
    # the runners hand over host tensors already; this catches any CUDA tensor still left
    tensors = []
    for name, value in values.items():
        if isinstance(value, str):
            tensors.append(bf16_bytes_tensor(name, value) if bf16_bytes else string_tensor(name, value))
        else:
            tensors.append(from_torch(name, value.cpu(), bf16_bytes))
    return tensors


def string_tensor(name: str, value: str):
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def read_string(request, name: str) -> str | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    value = t.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def request_parameters(request) -> dict:
    raw = request.parameters()
    return json.loads(raw) if raw else {}


def is_probe(request) -> bool:
    """A health probe (parameter action=probe, see omnistage.core.errors.PROBE_ACTION): answered at once."""
    return request_parameters(request).get("action") == PROBE_ACTION
