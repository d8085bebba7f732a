# omni_ensemble's usage report as OpenAI's two usage objects: a chat completion's and a realtime response's.
# The backend reports {prompt_tokens, cached_tokens, completion_tokens (text), audio_frames (codec frames,
# the audio tokens out), prompt_by_modality and cached_by_modality ({text, audio, image, video})}.
# OpenAI has no video tokens: a video's frames are images to the vision encoder, so they count as image
# tokens (a video's audio track already counts as audio). A report without the split (the prompt's part
# arrives with the thinker's first output) shows the whole prompt as text.
from __future__ import annotations

from typing import Any


def _split(reported: dict[str, Any], key: str, total: int) -> dict[str, int]:
    by = reported.get(key) or {"text": total}
    return {"text_tokens": int(by.get("text", 0)), "audio_tokens": int(by.get("audio", 0)),
            "image_tokens": int(by.get("image", 0)) + int(by.get("video", 0))}  # fmt: skip


def chat_usage(reported: dict[str, Any] | None, *, tokens_seen: int, audio_out: bool) -> dict[str, Any]:
    """`usage` of a chat completion. completion_tokens counts text tokens (what the thinker wrote, as
    vLLM-Omni counts them); the codec frames of a spoken reply are completion_tokens_details.audio_tokens."""
    reported = reported or {}
    prompt = int(reported.get("prompt_tokens", 0))
    completion = int(reported.get("completion_tokens", tokens_seen))
    # of the prompt, the tokens whose K/V came from the thinker's prefix cache (whole 16-token blocks)
    details = {"cached_tokens": int(reported.get("cached_tokens", 0)), **_split(reported, "prompt_by_modality", prompt)}
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion, "prompt_tokens_details": details}  # fmt: skip
    if audio_out:
        out["completion_tokens_details"] = {"audio_tokens": int(reported.get("audio_frames", 0))}
    return out


def realtime_usage(reported: dict[str, Any] | None, tokens_seen: int, frames_seen: int = 0) -> dict[str, Any]:
    """`usage` of a realtime response: output tokens are the text tokens and the codec frames (audio
    tokens); `tokens_seen` / `frames_seen` stand in for a report that has no output part (a cancelled
    response: what reached the client)."""
    reported = reported or {}
    prompt = int(reported.get("prompt_tokens", 0))
    cached = int(reported.get("cached_tokens", 0))
    text = int(reported.get("completion_tokens", tokens_seen))
    frames = int(reported.get("audio_frames", frames_seen))
    return {
        "total_tokens": prompt + text + frames, "input_tokens": prompt, "output_tokens": text + frames,
        "input_token_details": {"cached_tokens": cached, **_split(reported, "prompt_by_modality", prompt),
                                "cached_tokens_details": _split(reported, "cached_by_modality", cached)},
        "output_token_details": {"text_tokens": text, "audio_tokens": frames},
    }  # fmt: skip
