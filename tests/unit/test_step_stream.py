# StepStream (omnistage/stages/step_stream.py): work in run() goes to a stream of its own, ordered after
# what other threads queued on the default stream and complete when run() returns; disabled or off CUDA,
# it stays where the caller is.
import pytest
import torch

from omnistage.stages.step_stream import StepStream


def step(stream: StepStream, x: torch.Tensor):
    with stream.run():
        seen = torch.cuda.current_stream() if x.is_cuda else None
        return seen, (x @ x).sum(0)


def test_cpu_work_runs_as_it_is():
    stream = StepStream("cpu")
    assert stream.stream is None
    assert torch.equal(step(stream, torch.eye(3))[1], torch.ones(3))


@pytest.mark.gpu
def test_disabled_cuda_work_stays_on_the_callers_stream():
    stream = StepStream("cuda", enabled=False)
    assert stream.stream is None
    seen, _ = step(stream, torch.ones(4, 4, device="cuda"))
    assert seen == torch.cuda.default_stream()


@pytest.mark.gpu
def test_cuda_work_runs_on_its_own_stream_and_ends_complete():
    stream = StepStream("cuda", priority=-1)
    # an input queued on the default stream by another thread's copy: the step must see it
    x = torch.ones(2048, 2048, device="cuda").mul_(2)
    seen, out = step(stream, x)
    assert seen is not None and seen != torch.cuda.default_stream()
    assert stream.stream.query()  # nothing left in flight on it
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is back
    assert torch.equal(out, torch.full((2048,), 2048.0 * 4 * 2048, device="cuda"))
