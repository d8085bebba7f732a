# Stage loading against transformers' own from_pretrained on a tiny checkpoint in the released format.
import json

import pytest
import torch

from omnistage.models.checkpoint import STAGES, load_config, load_stage, load_text_embeddings
from omnistage.models.tiny_checkpoint import make_tiny_checkpoint
from omnistage.models.weights import CheckpointMismatchError

REAL_CONFIG = "/work/shared/reference/qwen3_omni_30b_a3b_instruct.config.json"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def full_model(tiny_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_dir).eval()


def _tensor_names(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_tiny_checkpoint_is_byte_identical_for_one_seed(tiny_dir, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_tiny_checkpoint_uses_released_layout(tiny_dir):
    names = _tensor_names(tiny_dir)
    assert "thinker.model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "talker.model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj") for n in names)
    assert {n.split(".")[0] for n in names} == set(STAGES)
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["talker_config"]["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert config["thinker_config"]["text_config"]["vocab_size"] == 152064


def _assert_same_tensors(got: dict, want: dict):
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def _forward(stage, module):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if stage == "thinker":
            ids = torch.randint(0, 151000, (1, 7), generator=gen)
            return module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        if stage == "talker":
            x = torch.randn(1, 6, module.config.text_config.hidden_size, generator=gen)
            pos = torch.arange(6).view(1, 1, -1).expand(3, 1, -1)
            logits = module(inputs_embeds=x, attention_mask=torch.ones(1, 6, dtype=torch.long), position_ids=pos).logits
            return torch.cat([logits.flatten(), module.code_predictor.model(inputs_embeds=x[:, :2]).last_hidden_state.flatten()])
        return module(torch.randint(0, 2048, (2, 16, 5), generator=gen))


@pytest.mark.parametrize("stage", STAGES)
def test_load_stage_equals_from_pretrained(tiny_dir, full_model, stage):
    module = load_stage(tiny_dir, stage, dtype=torch.float32, device="cpu")
    reference = getattr(full_model, stage)
    assert type(module) is type(reference) and not module.training
    _assert_same_tensors(module.state_dict(), reference.state_dict())
    _assert_same_tensors(dict(module.named_buffers()), dict(reference.named_buffers()))
    assert torch.equal(_forward(stage, module), _forward(stage, reference))


def test_load_stage_bf16_keeps_rotary_buffers_fp32(tiny_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.bfloat16).thinker
    module = load_stage(tiny_dir, "thinker", dtype="bfloat16")
    assert module.model.embed_tokens.weight.dtype == torch.bfloat16
    assert module.model.rotary_emb.inv_freq.dtype == torch.float32
    _assert_same_tensors(module.state_dict(), reference.state_dict())
    _assert_same_tensors(dict(module.named_buffers()), dict(reference.named_buffers()))


def _sharded_copy(tiny_dir, tmp_path, edit):
    # A sharded-layout view of the tiny checkpoint with an edited weight_map (the shard is symlinked).
    (tmp_path / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    (tmp_path / "model-00001-of-00001.safetensors").symlink_to(tiny_dir / "model.safetensors")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in _tensor_names(tiny_dir)}
    edit(weight_map)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_sharded_index_loads(tiny_dir, full_model, tmp_path):
    directory = _sharded_copy(tiny_dir, tmp_path, lambda m: None)
    module = load_stage(directory, "talker", dtype=torch.float32)
    _assert_same_tensors(module.state_dict(), full_model.talker.state_dict())


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("talker.model.layers.0.mlp.experts.2.up_proj.weight"), "1 missing"),
    (lambda m: m.pop("talker.codec_head.weight"), "1 missing"),
    (lambda m: m.__setitem__("talker.model.layers.0.mlp.bogus.weight", m["talker.codec_head.weight"]), "1 unexpected"),
    (lambda m: m.__setitem__("talker.model.layers.0.mlp.experts.9.up_proj.weight", m["talker.codec_head.weight"]),
     "1 unexpected"),
])
def test_missing_or_unexpected_keys_raise(tiny_dir, tmp_path, edit, message):
    directory = _sharded_copy(tiny_dir, tmp_path, edit)
    with pytest.raises(CheckpointMismatchError, match=message):
        load_stage(directory, "talker", dtype=torch.float32)


@pytest.mark.parametrize("stage", STAGES)
def test_dummy_is_deterministic_and_finite(full_model, stage):
    first = load_stage("dummy:tiny", stage, dtype=torch.float32, seed=3)
    second = load_stage("dummy:tiny", stage, dtype=torch.float32, seed=3)
    _assert_same_tensors(first.state_dict(), second.state_dict())
    for name, tensor in first.state_dict().items():
        assert torch.isfinite(tensor).all(), name
    # Buffers are derived from the config alone, so they must match transformers' own.
    _assert_same_tensors(dict(first.named_buffers()), dict(getattr(full_model, stage).named_buffers()))
    assert torch.isfinite(_forward(stage, first)).all()


@pytest.mark.parametrize("dummy", [False, True])
def test_the_talkers_text_table_is_the_thinkers(tiny_dir, dummy):
    # the talker looks up the user turns' text rows itself: in a table equal to the one the thinker embeds with
    source = "dummy:tiny" if dummy else tiny_dir
    thinker = load_stage(source, "thinker", torch.bfloat16, "cpu", seed=3 if dummy else 0)
    table = load_text_embeddings(source, torch.bfloat16, "cpu", seed=3 if dummy else 0)
    assert table.dtype == torch.bfloat16 and table.abs().sum() > 0
    assert torch.equal(table, thinker.get_input_embeddings().weight)
    if dummy:  # another seed, another table
        assert not torch.equal(table, load_text_embeddings(source, torch.bfloat16, "cpu", seed=4))


def test_dummy_seeds_talker_experts_and_routers():
    # _from_config leaves these torch.empty / zeros in transformers 5.17.
    talker = load_stage("dummy:tiny", "talker", dtype=torch.float32)
    other = load_stage("dummy:tiny", "talker", dtype=torch.float32, seed=1)
    experts = talker.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, other.model.layers[0].mlp.experts.gate_up_proj)
    assert 0.01 < experts.gate_up_proj.std().item() < 0.03 and 0.01 < experts.down_proj.std().item() < 0.03
    assert talker.model.layers[0].mlp.gate.weight.abs().sum() > 0


def test_real_config_parses():
    config = load_config(f"dummy:{REAL_CONFIG}")
    assert config.thinker_config.text_config.num_hidden_layers == 48
    assert config.talker_config.text_config.num_experts == 128
    assert config.talker_config.accept_hidden_layer == 24
    assert config.code2wav_config.sliding_window == 72


def test_bad_sources_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_config("dummy:/nonexistent/config.json")
    with pytest.raises(ValueError, match="unknown stage"):
        load_stage("dummy:tiny", "vocoder")


def test_generate_runs_on_tiny_checkpoint(tiny_dir, full_model):
    import base64
    import io
    import wave

    import numpy as np

    from omnistage.models.hf_compat import talker_audio_config_patch
    from omnistage.models.processor import load_processor, prepare_inputs

    processor = load_processor(tiny_dir)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.random.default_rng(0).standard_normal(16000) * 3000).astype("<i2").tobytes())
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    prompts = [[{"role": "user", "content": "Say hello."}],
               [{"role": "user", "content": [audio, {"type": "text", "text": "What was that?"}]}]]
    for messages in prompts:
        inputs = prepare_inputs(processor, messages)
        with talker_audio_config_patch(full_model), torch.no_grad():
            ids, wav = full_model.generate(
                **inputs, speaker="ethan", thinker_max_new_tokens=4, talker_max_new_tokens=6,
                thinker_do_sample=False, talker_do_sample=False, return_audio=True)
        assert ids.shape == (1, inputs["input_ids"].shape[1] + 4)
        assert wav.dim() == 3 and wav.shape[-1] > 0 and torch.isfinite(wav).all()
    assert "audio_config" not in full_model.talker.config.__dict__


def test_a_relative_checkpoint_path_is_relative_to_the_repository():
    from omnistage.launch.triton_env import REPO_ROOT
    from omnistage.models.checkpoint import resolve_checkpoint

    assert resolve_checkpoint("checkpoints/tiny") == str(REPO_ROOT / "checkpoints" / "tiny")
    assert resolve_checkpoint("dummy:perf/x.json") == f"dummy:{REPO_ROOT / 'perf' / 'x.json'}"
    assert resolve_checkpoint("/abs/ckpt") == "/abs/ckpt"
    assert resolve_checkpoint("dummy:tiny") == "dummy:tiny"  # the built-in tiny config, not a path
