# omni_ensemble's BLS client keeps nothing of a stage's response memory: every tensor it reads is a copy
# that owns its storage, so a response's tensors are released only when the iterator reaper drops the
# stream (omnistage/triton/bls.py::_read, omnistage/triton/iterator_reaper.py). Runs against a stand-in
# for the stub's module and response objects, which exist only inside a Triton Python-backend stub.
import sys
import types

import pytest
import torch
from torch.utils import dlpack

from omnistage.core.bf16_bytes import to_bf16_bytes
from omnistage.core.protocol import THINKER


class StubTensor:  # what a BLS response's output tensor offers: its name and a DLPack view of its memory
    def __init__(self, name, carrier):
        self._name, self.carrier = name, carrier

    def name(self):
        return self._name

    def to_dlpack(self):
        return dlpack.to_dlpack(self.carrier)


class StubResponse:
    def __init__(self, tensors):
        self.tensors = tensors

    def has_error(self):
        return False

    def output_tensors(self):
        return self.tensors


@pytest.fixture
def bls(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    for name in ("omnistage.triton.bls", "omnistage.triton.tensors"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import omnistage.triton.bls as module

    yield module
    for name in ("omnistage.triton.bls", "omnistage.triton.tensors"):  # not left bound to the stand-in
        sys.modules.pop(name, None)


def test_read_copies_host_tensors_out_of_the_response(bls):
    audio, frames = torch.randn(3, 2048), torch.tensor([7], dtype=torch.int64)  # a float and an int output
    carriers = {"text_rows": to_bf16_bytes(audio), "token_ids": to_bf16_bytes(frames)}
    response = StubResponse([StubTensor(name, c) for name, c in carriers.items()])
    out = bls._read(response, {t.name: t for t in THINKER.outputs})
    assert torch.equal(out["text_rows"], audio) and torch.equal(out["token_ids"], frames)
    for name, carrier in carriers.items():
        assert out[name].untyped_storage().data_ptr() != carrier.untyped_storage().data_ptr(), name
    want = audio.clone()
    carriers["text_rows"].zero_()  # the response's memory reused: what was read stays
    assert torch.equal(out["text_rows"], want) and not torch.equal(audio, want)


def test_a_stream_is_sent_when_called_not_when_first_read(bls, monkeypatch):
    # omni_ensemble starts the talker on the thinker's thread and reads its stream on another; the appends
    # the thinker's thread sends next must reach the stage after the start, read or not
    sent = []

    class Request:
        def __init__(self, model_name, inputs, requested_output_names, parameters):
            self.parameters = parameters

        def exec(self, decoupled):
            sent.append(self.parameters["action"])
            return iter([StubResponse([])])

    monkeypatch.setattr(bls.pb_utils, "InferenceRequest", Request, raising=False)
    monkeypatch.setattr(bls, "from_torch", lambda name, value: name)
    reaped = []
    client = bls.BlsStageClient(types.SimpleNamespace(hold=reaped.append))
    stream = client.talker("s", {}, {})
    client.talker_append("s", torch.zeros(1, 4), end=True)
    assert sent == ["start", "append"]
    assert list(stream) == [] and len(reaped) == 2  # read to its end, then handed to the reaper
