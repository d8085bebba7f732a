"""Stage outputs cross BLS as BF16 views of their bytes (core/bf16_bytes.py): the round trip must give back
every output of every stage contract bit for bit, with its dtype and shape."""

import pytest
import torch

from omnistage.core.bf16_bytes import TORCH_DTYPES, from_bf16_bytes, to_bf16_bytes
from omnistage.core.protocol import CODE2WAV, TALKER, THINKER


def _example(data_type: str, dims: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    shape = [3 if d == -1 else d for d in dims]
    dtype = TORCH_DTYPES[data_type]
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40) if dtype == torch.int64 else -1000, 2**40 if dtype == torch.int64 else 1000, shape,
                         generator=gen, dtype=dtype)  # fmt: skip


STAGE_OUTPUTS = [(c.name, spec) for c in (THINKER, TALKER, CODE2WAV) for spec in c.outputs]


@pytest.mark.parametrize("stage,spec", STAGE_OUTPUTS, ids=[f"{c}.{s.name}" for c, s in STAGE_OUTPUTS])
def test_every_stage_output_survives_the_round_trip(stage, spec):
    if spec.data_type == "TYPE_STRING":
        for value in ("stop", "length", "abort", "", "é ünïcode"):
            carrier = to_bf16_bytes(value)
            assert carrier.dtype == torch.bfloat16
            assert from_bf16_bytes(carrier, spec.data_type) == value
        return
    value = _example(spec.data_type, spec.dims, torch.Generator().manual_seed(len(spec.name)))
    carrier = to_bf16_bytes(value)
    assert carrier.dtype == torch.bfloat16
    assert carrier.shape[:-1] == value.shape[:-1]  # only the last dim changes
    back = from_bf16_bytes(carrier, spec.data_type)
    assert back.dtype == value.dtype and back.shape == value.shape
    assert torch.equal(back, value)


def test_the_view_shares_memory_and_keeps_nan_payloads():
    """No copy for wide dtypes (the code2wav state is megabytes), and the bits are kept as they are."""
    value = torch.tensor([float("nan"), -0.0, 1e-45, 3.4e38], dtype=torch.float32)
    carrier = to_bf16_bytes(value)
    assert carrier.data_ptr() == value.data_ptr()
    back = from_bf16_bytes(carrier.clone(), "TYPE_FP32")
    assert torch.equal(back.view(torch.int32), value.view(torch.int32))


def test_empty_and_non_contiguous_tensors():
    rows = torch.empty(0, 7)
    assert from_bf16_bytes(to_bf16_bytes(rows), "TYPE_FP32").shape == (0, 7)
    strided = torch.arange(32, dtype=torch.int64).reshape(2, 16).t()  # [16, 2], not contiguous
    assert torch.equal(from_bf16_bytes(to_bf16_bytes(strided), "TYPE_INT64"), strided)
