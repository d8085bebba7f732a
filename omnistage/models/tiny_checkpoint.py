# A tiny random-weight Qwen3-Omni checkpoint in the released on-disk format (per-expert tensor names,
# tokenizer files with chat template, preprocessor_config.json), for CPU tests of the whole pipeline.
import json
from pathlib import Path

import torch

# Released preprocessor settings except max_pixels: the tiny vision tower runs on CPU in tests, and
# 512x512 keeps a stray large image to ~1k patches instead of ~50k.
TINY_PREPROCESSOR = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
    "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0,
    "dither": 0.0, "return_attention_mask": True,
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 3136, "max_pixels": 512 * 512,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def make_tiny_checkpoint(out_dir, seed: int = 0) -> Path:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.random_init import init_random_weights_, make_code2wav_audible_
    from omnistage.models.skeleton import empty_stage
    from omnistage.models.tiny_config import tiny_config_dict
    from omnistage.models.tokenizer import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3OmniMoeConfig(**tiny_config_dict())
    model = empty_stage(Qwen3OmniMoeForConditionalGeneration, config, torch.float32, "cpu")
    init_random_weights_(model, seed)
    make_code2wav_audible_(model.code2wav, seed)  # playable audio, not ~1e-6 noise
    # save_pretrained reverses the fused-expert conversion, writing the released per-expert names.
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2, sort_keys=True) + "\n")
    return out
