# The thinker and talker runners hand their outputs over in pinned host memory, copied behind the step's
# work and complete at the step's own sync (omnistage/stages/host_copy.py). The outputs must be on the host,
# complete, whichever way a step ends (rows finishing or going on).
import copy

import pytest
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.host_copy import outputs_to_host, to_host
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerOutput, ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import REPLY, run_thinker, running


def run_pair(model, input_ids, device):
    """A thinker reply, then two talker streams of different lengths side by side (the shorter one
    finishes while the other goes on). Returns the thinker output and each stream's frames."""
    kw = {"max_slots": 4, "max_seq_len": 512, "device": device, "dtype": torch.float32}
    thinker = ThinkerRunner(model.thinker, model.config, **kw)
    prompt = ThinkerPrompt(input_ids, export_talker=True)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY), prompt, slot=1))
    talker = TalkerRunner(model.talker, model.config, model.thinker.get_input_embeddings().weight, **kw)
    seqs = [running(name, SamplingParams(max_tokens=n, repetition_penalty=1.05),
                    TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True), slot)
            for name, n, slot in (("short", 3, 0), ("long", 7, 2))]  # fmt: skip
    frames = {s.request_id: [] for s in seqs}
    results = talker.prefill(seqs)  # with frame 0 of each
    while results:
        for r in results:
            if r.output is not None:
                frames[r.seq.request_id].append(r.output.codes)
        live = [r.seq for r in results if r.finish_reason is None]
        results = talker.decode(live) if live else []
    return out, {k: torch.cat(v) for k, v in frames.items()}


def host_tensors(obj):
    found = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif hasattr(value, "__dataclass_fields__"):
            found += host_tensors(value)
    return found


def test_a_cpu_runner_hands_over_every_stream_in_full(hf_model, processor):
    ids = prepare_inputs(processor, oracle.messages("text"))["input_ids"][0]
    out, frames = run_pair(hf_model, ids, "cpu")
    assert len(out.token_ids) == REPLY and out.text_rows.shape[0] == REPLY
    assert [f.shape[0] for f in frames.values()] == [3, 7]


def test_host_tensors_stay_as_they_are():
    rows = torch.ones(1, 4)
    out = ThinkerOutput(token_ids=[1], text_rows=rows)
    outputs_to_host([out, None], torch.device("cpu"))
    assert out.text_rows is rows and to_host(rows) is rows


@pytest.mark.gpu
def test_cuda_outputs_arrive_on_the_host_complete(hf_model, processor):
    ids = prepare_inputs(processor, oracle.messages("text"))["input_ids"][0]
    model = copy.deepcopy(hf_model).to("cuda")
    want_out, want_frames = run_pair(hf_model, ids, "cpu")
    out, frames = run_pair(model, ids, "cuda")
    assert out.token_ids == want_out.token_ids
    tensors = host_tensors(out) + list(frames.values())
    assert all(t.device.type == "cpu" for t in tensors)
    for got, want in zip(host_tensors(out), host_tensors(want_out)):
        assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-4)
    assert {k: f.shape for k, f in frames.items()} == {k: f.shape for k, f in want_frames.items()}


@pytest.mark.gpu
def test_to_host_is_complete_after_the_streams_sync():
    x = torch.randn(4096, 4096, device="cuda")
    y = x @ x  # still running when the copy is queued
    host = to_host(y)
    assert host.is_pinned()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host, y.cpu())
    z = x @ y  # in flight again: outputs_to_host must wait for its copy
    out = ThinkerOutput(token_ids=[1], text_rows=z[:2])
    outputs_to_host([out], z.device)
    assert out.text_rows.device.type == "cpu" and torch.equal(out.text_rows, z[:2].cpu())
