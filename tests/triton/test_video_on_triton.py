# A video prompt served by a real tritonserver (tiny checkpoint): text tokens and audio equal transformers'
# generate() on the same clip, with and without its audio track (use_audio_in_video); a clip over a limit is
# a 400 before it is decoded.
import pytest
import torch

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.processor import prepare_inputs

from .. import oracle
from ..video_clips import make_video, video_data_url
from .conftest import RepoSpec
from .omni_client import omni

REPLY, FRAMES = 6, 12
GREEDY = {"temperature": "0", "talker_temperature": "0", "talker_repetition_penalty": "1.05"}


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    spec = default_spec(str(tiny_checkpoint), "cpu")
    spec["omni_ensemble"].parameters["max_video_seconds"] = "30"
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository")


def _messages(raw: bytes) -> list:
    return [oracle.SYSTEM, {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_data_url(raw)}},
                                                         {"type": "text", "text": "What happens here?"}]}]  # fmt: skip


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "frames+audio"])
def test_served_video_equals_generate(with_audio, triton_server, hf_model, processor):
    msgs = _messages(make_video(seconds=2.0, fps=10, audio=True, seed=3))
    inputs = prepare_inputs(processor, msgs, use_audio_in_video=with_audio)
    want_text, want_codes, want_wav = oracle.generate(hf_model, dict(inputs, use_audio_in_video=with_audio), REPLY, FRAMES)
    params = dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES, use_audio_in_video=with_audio)
    r = omni(triton_server.grpc_url, msgs, params)
    assert r.error is None, r.error
    assert r.token_ids == want_text
    assert r.usage["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert r.waveform.shape[0] == want_wav.shape[0] == want_codes.shape[0] * 1920 - 555
    assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4


def test_video_over_the_limit_is_a_400(triton_server):
    long = make_video(seconds=31.0, fps=2, width=64, height=64, audio=False)
    r = omni(triton_server.grpc_url, _messages(long), dict(GREEDY, max_tokens=2))
    assert r.error is not None and "400" in r.error and "over the limit of 30 s" in r.error, r.error
