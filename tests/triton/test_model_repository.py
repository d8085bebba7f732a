# The checked-in model_repository/ is the product: each model's config.pbtxt is what the renderer makes of
# the base profile (platform cpu), byte for byte, and tritonserver serves the directory as it is, with no
# render step, over the tiny checkpoint at its default path (checkpoints/tiny, a model parameter relative
# to the repository). By hand, from the repository root, in the launcher's environment:
#   eval "$(.venv/bin/python -m omnistage.launch.triton_env)"
#   "$TRITONSERVER" --model-repository=model_repository --backend-directory="$TRITON_BACKENDS" \
#       --backend-config=python,thread-pool-size=512
import pytest
import torch

from omnistage.launch.render import CHECKED_IN_MODEL, MODEL_REPOSITORY, checked_in_configs
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.launch.tritonserver import TritonServer
from omnistage.models.processor import load_processor, prepare_inputs

from .. import oracle
from .omni_client import omni

REPLY, FRAMES = 6, 30
GREEDY = {"temperature": "0", "talker_temperature": "0", "talker_repetition_penalty": "1.05"}


def test_checked_in_configs_are_the_rendered_base_profile():
    configs = checked_in_configs()
    on_disk = {p.parent.name: p.read_text() for p in MODEL_REPOSITORY.glob("*/config.pbtxt")}
    assert sorted(on_disk) == sorted(configs) == ["code2wav", "omni_ensemble", "talker", "thinker"]
    for name, text in configs.items():
        assert on_disk[name] == text, f"model_repository/{name}/config.pbtxt differs: python -m omnistage.launch.render --checked-in"
    assert all(f'string_value: "{CHECKED_IN_MODEL}"' in text for text in configs.values())


@pytest.fixture(scope="module")
def default_checkpoint():
    """The checkpoint the repository names, made as `make tiny` makes it where a clean clone has none."""
    path = REPO_ROOT / CHECKED_IN_MODEL
    if not (path / "config.json").is_file():
        from omnistage.models.tiny_checkpoint import make_tiny_checkpoint

        make_tiny_checkpoint(path, seed=0)
    return path


def test_tritonserver_serves_the_repository_as_it_is(default_checkpoint, tmp_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    server = TritonServer.on_free_ports(MODEL_REPOSITORY, tmp_path / "run", model_control_mode="none", load_models=())
    server.start()
    try:
        server.wait_ready(timeout=300)
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(default_checkpoint, dtype=torch.float32).eval()
        processor = load_processor(default_checkpoint)
        msgs = oracle.messages("text")
        want_text, want_codes, want_wav = oracle.generate(model, prepare_inputs(processor, msgs), REPLY, FRAMES)
        r = omni(server.grpc_url, msgs, dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES))
        assert r.error is None, r.error
        assert r.token_ids == want_text
        assert r.waveform.shape[0] == want_wav.shape[0] == want_codes.shape[0] * 1920 - 555
        assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4
    finally:
        server.stop()
