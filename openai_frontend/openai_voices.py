# OpenAI's built-in voice names in the OpenAI-shaped voice fields (chat `audio.voice`, `/v1/audio/speech`
# `voice`, the realtime `audio.output.voice`). Clients written for OpenAI send one of them without being
# asked: the openai SDK requires a voice for speech, and LiveKit's and Pipecat's OpenAI realtime plugins set
# one in the session.update they open with. The checkpoint has none of those speakers, so each is spoken in the
# server's default voice. vLLM-Omni's own fields (top-level `speaker` and `voice`) take only the checkpoint's
# names, as vLLM-Omni does; any other name is an `invalid_voice` 400 in every field.
from __future__ import annotations

from typing import Any

from omnistage.core.voices import normalize_voice, resolve_voice

from openai_frontend.settings import FrontendSettings

# the voice literals of the openai SDK's chat, realtime and speech parameters, together
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})  # fmt: skip


def openai_voice(name: Any, settings: FrontendSettings, param: str) -> str:
    """The checkpoint voice that speaks for `name` (a string; None: the default): a checkpoint voice by its own
    name (any case), an OpenAI built-in one by the default voice. Anything else: BadRequestError naming `param`."""
    voice = normalize_voice(name) if isinstance(name, str) else None
    if voice in OPENAI_VOICES and voice not in settings.voices:
        return settings.default_voice
    return resolve_voice(name, settings.voices, default=settings.default_voice, param=param)
