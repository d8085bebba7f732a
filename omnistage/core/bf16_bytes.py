# Host tensors reinterpreted as BF16 tensors over the same bytes, and back: how stage outputs cross BLS.
#
# Why: Triton 2.51's Python stub can free BLS responses in one of its native threads, off the GIL
# (triton/iterator_reaper.py has the mechanism and the fix). The stub makes a numpy array of the data of
# each host tensor it receives, except a BF16 one; so a BF16 view of the bytes spares that array, one
# Python object less per tensor for anything to free. It was the first fix of the crash and is not a
# sufficient one: each tensor still owns two empty numpy arrays (PbTensor's default py::array members).
#
# The view keeps every dim but the last, whose length scales by the element size over 2 bytes; 1-byte
# dtypes are widened to int16 first, and a string travels as the int16 values of its UTF-8 bytes.
from __future__ import annotations

import torch

# Triton config spelling -> torch dtype, for the data types our contracts use (strings are str)
TORCH_DTYPES = {
    "TYPE_FP32": torch.float32,
    "TYPE_FP16": torch.float16,
    "TYPE_BF16": torch.bfloat16,
    "TYPE_INT64": torch.int64,
    "TYPE_INT32": torch.int32,
    "TYPE_BOOL": torch.bool,
}
_WIDENED = (torch.bool, torch.uint8, torch.int8)  # 1-byte dtypes: carried as int16


def to_bf16_bytes(value: torch.Tensor | str) -> torch.Tensor:
    """A host tensor (or a string) as a BF16 tensor; no copy unless the tensor is 1-byte or not contiguous."""
    if isinstance(value, str):
        value = torch.tensor(list(value.encode("utf-8")), dtype=torch.int16)
    if value.dim() == 0:
        value = value.reshape(1)
    if value.dtype in _WIDENED:
        value = value.to(torch.int16)
    return value.contiguous().view(torch.bfloat16)


def from_bf16_bytes(carrier: torch.Tensor, data_type: str) -> torch.Tensor | str:
    """Inverse of to_bf16_bytes for a tensor declared as `data_type` (Triton spelling) in its contract."""
    if data_type == "TYPE_STRING":
        return bytes(carrier.view(torch.int16).to(torch.uint8).tolist()).decode("utf-8")
    dtype = TORCH_DTYPES[data_type]
    if dtype in _WIDENED:
        return carrier.view(torch.int16).to(dtype)
    return carrier.view(dtype)
