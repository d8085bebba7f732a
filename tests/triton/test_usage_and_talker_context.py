# What a client reads about its prompt, over the real pipeline (tiny checkpoint, real tritonserver,
# `python -m openai_frontend`, the openai SDK): a spoken request whose talker prompt and frames cannot fit
# the talker's context is a 400 before any byte, naming the talker prompt's length as transformers'
# generate() builds it, and served at the boundary; usage breaks the prompt down by modality.
import openai
import pytest

from omnistage.launch.render import default_spec
from omnistage.models.checkpoint import load_config
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.processor import prepare_inputs

from .. import oracle
from ..api.servers import FrontendProcess
from .conftest import RepoSpec

TALKER_ROOM = 1024 - 1  # the base profile's talker max_seq_len, less the frame after the last one's
# a conversation with every kind of turn the talker prompt keeps or drops: system, image, assistant, audio
CONVERSATION = [
    oracle.SYSTEM,
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": oracle.png_data_url()}},
                                 {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A picture of noise."},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": oracle.wav_base64(), "format": "wav"}},
                                 {"type": "text", "text": "And this?"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    return RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository")


@pytest.fixture(scope="module")
def frontend(triton_server):
    with FrontendProcess("--triton-url", triton_server.grpc_url) as f:
        yield f


def client(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)


def generate_talker_prompt_length(model, inputs: dict) -> int:
    """The length of the prompt transformers' generate() hands its talker for `inputs`."""
    lengths = []
    original = model.talker.generate

    def capture(*args, **kwargs):
        lengths.append(kwargs["inputs_embeds"].shape[1])
        return original(*args, **kwargs)

    model.talker.generate = capture
    try:
        oracle.generate(model, inputs, reply_tokens=1, frames=1)
    finally:
        model.talker.generate = original
    return lengths[0]


def spoken(frontend, frames: int):
    """A streamed spoken reply of two text tokens and `frames` codec frames."""
    return client(frontend).chat.completions.create(
        model="qwen3-omni", messages=CONVERSATION, audio={"voice": "ethan", "format": "pcm16"}, stream=True,
        max_tokens=2, extra_body={"sampling_params_list": [{}, {"max_tokens": frames, "ignore_eos": True}]})  # fmt: skip


def test_talker_frames_beyond_its_context_are_a_400_before_any_byte(frontend, hf_model, processor):
    rows = generate_talker_prompt_length(hf_model, prepare_inputs(processor, CONVERSATION))
    with pytest.raises(openai.BadRequestError) as caught:
        spoken(frontend, TALKER_ROOM - rows + 1)
    error = caught.value.body
    assert (error["param"], error["code"]) == ("talker_max_tokens", "context_length_exceeded")
    assert f"context is {TALKER_ROOM} tokens and the prompt has {rows} " in error["message"]
    # at the boundary the talker starts and speaks (the client stops listening after the first audio)
    stream = spoken(frontend, TALKER_ROOM - rows)
    try:
        audio = next(c for c in stream if c.choices and c.choices[0].delta.audio and c.choices[0].delta.audio.data)
    finally:
        stream.close()
    assert audio.choices[0].delta.audio.data


def test_usage_breaks_the_prompt_down_by_modality(frontend, processor, tiny_checkpoint):
    ids = prepare_inputs(processor, CONVERSATION)["input_ids"].reshape(-1)
    t = load_config(str(tiny_checkpoint)).thinker_config
    audio, image = (int((ids == token).sum()) for token in (t.audio_token_id, t.image_token_id))
    assert audio > 0 and image > 0
    ask = dict(model="qwen3-omni", messages=CONVERSATION, modalities=["text"], max_tokens=2, temperature=0)
    whole = client(frontend).chat.completions.create(**ask).usage
    streamed = [c for c in client(frontend).chat.completions.create(**ask, stream=True,
                                                                     stream_options={"include_usage": True})
                if c.usage is not None][-1].usage  # fmt: skip
    # a stop string cancels the backend request: the prompt's usage came with the thinker's first output
    stopped = client(frontend).chat.completions.create(**dict(ask, max_tokens=50), stop=[" ", "a", "e", "o"])
    assert stopped.choices[0].finish_reason == "stop"
    for usage in (whole, streamed, stopped.usage):
        details = usage.prompt_tokens_details
        assert usage.prompt_tokens == ids.numel()
        assert (details.audio_tokens, details.image_tokens) == (audio, image)
        assert details.text_tokens == ids.numel() - audio - image
