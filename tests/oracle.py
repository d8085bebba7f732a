# transformers' own generate() on the tiny checkpoint: the correctness oracle of the stages.
#
# Two off-by-ones of generate() are accounted for here, not copied into the server:
# - the talker speaks the reply tokens that were fed back into the thinker, so a reply cut by
#   max_new_tokens=N+1 speaks exactly N tokens; our server speaks all N tokens of a max_tokens=N reply;
# - talker_max_new_tokens=F+1 yields F frames (the last codebook-0 token never gets its residuals).
import base64
import io
import wave

import numpy as np
import torch
from PIL import Image

from omnistage.models.hf_compat import talker_audio_config_patch
from omnistage.models.pixels import scale_pixels
from omnistage.models.processor import load_pixel_table


def generate(model, inputs: dict, reply_tokens: int, frames: int, speaker="ethan", repetition_penalty=1.05):
    """inputs: prepare_inputs()'s; its pixel bytes go to generate() as the image processor's floats (equal to
    them exactly: test_processor.py)."""
    table = load_pixel_table("dummy:")
    inputs = {k: scale_pixels(v, table) if k in ("pixel_values", "pixel_values_videos") else v for k, v in inputs.items()}
    captured = {}
    original = model.talker.generate

    def capture(*args, **kwargs):
        captured["talker"] = result = original(*args, **kwargs)
        return result

    model.talker.generate = capture
    try:
        with talker_audio_config_patch(model), torch.no_grad():
            sequences, wav = model.generate(
                **inputs, speaker=speaker, thinker_max_new_tokens=reply_tokens + 1, thinker_do_sample=False,
                talker_max_new_tokens=frames + 1, talker_do_sample=False,
                talker_repetition_penalty=repetition_penalty,
            )  # fmt: skip
    finally:
        model.talker.generate = original
    hidden = captured["talker"].hidden_states
    codes = torch.stack([h[-1] for h in hidden if h[-1] is not None], dim=1)[0]  # [frames, 16]
    text = sequences[0, inputs["input_ids"].shape[1] :].tolist()[:reply_tokens]
    return text, codes, wav.reshape(-1)


def png_data_url(seed=0, size=64) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_base64(seconds=1.0, rate=16000, seed=0) -> str:
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(rate * seconds)) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


SYSTEM = {"role": "system", "content": "You are a voice assistant."}


def messages(kind: str, text="Say hello!") -> list:
    parts = [{"type": "text", "text": text}]
    if kind == "image":
        parts.insert(0, {"type": "image_url", "image_url": {"url": png_data_url()}})
    if kind == "audio":
        parts.insert(0, {"type": "input_audio", "input_audio": {"data": wav_base64(), "format": "wav"}})
    return [SYSTEM, {"role": "user", "content": parts}]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
