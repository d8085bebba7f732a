# Per-stage model loading, so each stage process holds only its own weights.
# A source is either a HF checkpoint directory (config.json + safetensors shards) or
# `dummy:<config.json>` (random weights drawn on the target device; `dummy:tiny` = the tiny config).
import json
from pathlib import Path

import torch

STAGES = ("thinker", "talker", "code2wav")
DUMMY_PREFIX = "dummy:"
# a relative checkpoint path (model_repository/'s default, checkpoints/tiny) is relative to the repository,
# not to the working directory of whichever process reads it
REPO_ROOT = Path(__file__).resolve().parents[2]


def _stage_class(stage: str):
    import transformers

    names = {
        "thinker": "Qwen3OmniMoeThinkerForConditionalGeneration",
        "talker": "Qwen3OmniMoeTalkerForConditionalGeneration",
        "code2wav": "Qwen3OmniMoeCode2Wav",
    }
    if stage not in names:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    return getattr(transformers, names[stage])


def is_dummy(source) -> bool:
    return str(source).startswith(DUMMY_PREFIX)


def resolve_checkpoint(source: str) -> str:
    """A checkpoint dir or dummy:<config.json> with a relative path made absolute against the repository
    root (`dummy:tiny` names the built-in tiny config and stays as it is)."""
    prefix = DUMMY_PREFIX if is_dummy(source) else ""
    path = str(source)[len(prefix):]
    if (prefix and path == "tiny") or Path(path).is_absolute():
        return str(source)
    return prefix + str(REPO_ROOT / path)


def load_config(source):
    from transformers import Qwen3OmniMoeConfig

    source = str(source)
    if is_dummy(source):
        path = source[len(DUMMY_PREFIX):]
        if path == "tiny":
            from omnistage.models.tiny_config import tiny_config_dict

            return Qwen3OmniMoeConfig(**tiny_config_dict())
        if not Path(path).is_file():
            raise FileNotFoundError(f"dummy config {path} does not exist")
        return Qwen3OmniMoeConfig.from_dict(json.loads(Path(path).read_text()))
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not a checkpoint directory (no config.json)")
    return Qwen3OmniMoeConfig.from_pretrained(source, local_files_only=True)


def speaker_names(source) -> list[str]:
    """The talker's voices, lower case, in the checkpoint's order (what the frontend offers)."""
    return [name.lower() for name in load_config(source).talker_config.speaker_id]


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return dtype


def stage_seed(seed: int, stage: str) -> int:
    # Distinct streams per stage, so dummy thinker and talker weights are not copies of each other.
    return int(seed) * 1009 + STAGES.index(stage)


def load_stage(source, stage: str, dtype=torch.bfloat16, device="cpu", seed: int = 0, *,
               attn_implementation: str | None = None, experts_implementation: str | None = None):
    """Returns the eval-mode transformers module of one stage: thinker -> ThinkerForConditionalGeneration,
    talker -> TalkerForConditionalGeneration (with its code predictor), code2wav -> Code2Wav."""
    from omnistage.models import attention, experts
    from omnistage.models.random_init import init_random_weights_, make_code2wav_audible_
    from omnistage.models.skeleton import empty_stage
    from omnistage.models.weights import load_prefixed_

    experts.register()  # our experts implementation name is valid from here on
    cls = _stage_class(stage)
    config = load_config(source)
    sub_config = getattr(config, f"{stage}_config")
    if stage != "thinker" and not config.enable_audio_output:
        raise ValueError(f"{source}: enable_audio_output is false, the checkpoint has no {stage}")
    model = empty_stage(cls, sub_config, _resolve_dtype(dtype), device,
                        attn_implementation=attn_implementation, experts_implementation=experts_implementation)
    if is_dummy(source):
        init_random_weights_(model, stage_seed(seed, stage))
        if stage == "thinker":  # the talker draws the same table (load_text_embeddings)
            with torch.no_grad():
                model.get_input_embeddings().weight.copy_(_dummy_text_embeddings(config, seed, model.dtype, device))
        if stage == "code2wav":  # initializer_range alone gives ~1e-6 (tiny) or a clipped roar (full size)
            make_code2wav_audible_(model, stage_seed(seed, stage))
    else:
        load_prefixed_(model, Path(source), stage)
    if attn_implementation is None and stage != "code2wav":
        attention.use_for_text_decoders(model)  # grouped-query decode steps without repeat_kv's copies
    return model.eval().requires_grad_(False)


TEXT_EMBEDDINGS = "thinker.model.embed_tokens.weight"


@torch.no_grad()
def load_text_embeddings(source, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> torch.Tensor:
    """The thinker's token embedding table [vocab, D], for the talker: it looks up the text rows of a
    prompt's user turns itself, so the thinker hands it only the rows it cannot look up (media rows)."""
    dtype = _resolve_dtype(dtype)
    if is_dummy(source):
        return _dummy_text_embeddings(load_config(source), seed, dtype, device)
    from safetensors import safe_open

    from omnistage.models.weights import tensor_files

    with safe_open(str(tensor_files(Path(source))[TEXT_EMBEDDINGS]), framework="pt") as f:
        return f.get_tensor(TEXT_EMBEDDINGS).to(device=device, dtype=dtype)


def _dummy_text_embeddings(config, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A dummy thinker's embedding table, drawn from a generator of its own so that the talker's process
    draws the same one without drawing the rest of the thinker (same seed, dtype and device type)."""
    text = config.thinker_config.text_config
    gen = torch.Generator(device=device).manual_seed(stage_seed(seed, "thinker") + len(STAGES))
    table = torch.empty(text.vocab_size, text.hidden_size, dtype=dtype, device=device)
    table.normal_(0.0, text.initializer_range, generator=gen)
    if text.pad_token_id is not None:
        table[text.pad_token_id].zero_()  # as nn.Embedding's padding_idx leaves it
    return table
