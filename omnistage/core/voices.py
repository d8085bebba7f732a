# The talker's voice of one request, resolved and validated in one place for every layer: the frontend
# (OpenAI `audio.voice`, vLLM-Omni `speaker` / `voice`), omni_ensemble and the talker stage.
from __future__ import annotations

from collections.abc import Iterable

from .errors import BadRequestError

DEFAULT_VOICE = "ethan"  # Qwen3-Omni's default speaker, in the released checkpoint and the tiny one


def normalize_voice(name: str) -> str:
    return name.strip().lower()


def resolve_voice(name: str | None, voices: Iterable[str], *, default: str = DEFAULT_VOICE,
                  param: str = "voice") -> str:
    """`name` (any case) or the default when None; a voice the checkpoint lacks is a 400 naming `param`."""
    known = list(voices)
    voice = default if name is None else normalize_voice(str(name))
    if voice not in known:
        raise BadRequestError(f"unknown voice {voice!r}; valid voices: {', '.join(known)}", param=param,
                              code="invalid_voice")
    return voice
