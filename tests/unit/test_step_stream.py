# With step_stream on, engine steps run on a stream of their own (omnistage/stages/step_stream.py): not
# the legacy default stream that Triton's response copies synchronise, ordered after what other threads
# queued there, and complete when the step returns. Off, they stay where the caller is.
import pytest
import torch

from omnistage.stages.step_stream import StepStream, on_step_stream


class Runner:
    def __init__(self, device, enabled=True):
        self.step_stream = StepStream(device, enabled)
        self.seen = None

    @on_step_stream
    def decode(self, x):
        self.seen = torch.cuda.current_stream() if x.is_cuda else None
        return (x @ x).sum(0)


def test_cpu_steps_run_as_they_are():
    runner = Runner("cpu")
    assert runner.step_stream.stream is None
    assert torch.equal(runner.decode(torch.eye(3)), torch.ones(3))


@pytest.mark.gpu
def test_disabled_cuda_steps_stay_on_the_callers_stream():
    runner = Runner("cuda", enabled=False)
    assert runner.step_stream.stream is None
    runner.decode(torch.ones(4, 4, device="cuda"))
    assert runner.seen == torch.cuda.default_stream()


@pytest.mark.gpu
def test_cuda_steps_run_on_their_own_stream_and_end_complete():
    runner = Runner("cuda")
    # an input queued on the default stream by another thread's copy: the step must see it
    x = torch.ones(2048, 2048, device="cuda").mul_(2)
    out = runner.decode(x)
    assert runner.seen is not None and runner.seen != torch.cuda.default_stream()
    assert runner.step_stream.stream.query()  # nothing left in flight on it
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is back
    assert torch.equal(out, torch.full((2048,), 2048.0 * 4 * 2048, device="cuda"))
