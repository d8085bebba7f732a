# A validated ChatCompletionRequest resolved into what one `omni_ensemble` request needs: the messages,
# the flat request parameters (omnistage.core.protocol.OMNI.parameters) and how to shape the response.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import FrontendError
from openai_frontend.schemas import ChatCompletionRequest, Sampling
from openai_frontend.settings import FrontendSettings

_SAMPLING_FIELDS = tuple(Sampling.model_fields)
_STAGE_PREFIX = ("", "talker_")  # sampling_params_list index -> OMNI parameter prefix; code2wav has none


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict[str, Any]]
    parameters: dict[str, Any]
    text_out: bool  # reply text in message.content / delta.content
    audio_out: bool
    audio_format: str  # audio_encoding.FORMATS
    stream: bool
    include_usage: bool
    response_style: str = "openai"  # settings.RESPONSE_STYLES
    stop: tuple[str, ...] = ()  # stop strings, matched on the reply text


def plan_chat(req: ChatCompletionRequest, settings: FrontendSettings) -> ChatPlan:
    modalities = req.modalities or ["text", "audio"]  # vLLM-Omni's default: text and speech
    text_out, audio_out = "text" in modalities, "audio" in modalities
    voice = _voice(req, settings)

    parameters: dict[str, Any] = {"modalities": ",".join(m for m in ("text", "audio") if m in modalities)}
    if audio_out:
        parameters["speaker"] = voice
    # Per-stage entries first, so that the top-level OpenAI fields (the thinker's) win over entry 0.
    for prefix, stage in zip(_STAGE_PREFIX, req.sampling_params_list or ()):
        if stage is not None:
            parameters.update(_sampling(stage, prefix))
    parameters.update(_sampling(req, ""))
    if req.max_completion_tokens is not None:  # OpenAI's newer name wins over max_tokens
        parameters["max_tokens"] = req.max_completion_tokens

    return ChatPlan(
        messages=[m.model_dump(exclude_unset=True) for m in req.messages],
        parameters=parameters,
        text_out=text_out,
        audio_out=audio_out,
        audio_format=req.audio.format if req.audio else "wav",
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        response_style=req.response_style or settings.response_style,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
    )


def _voice(req: ChatCompletionRequest, settings: FrontendSettings) -> str:
    # OpenAI's audio.voice first, then vLLM-Omni's top-level speaker / voice; names are already lower case.
    # Every one given must exist, used or not: a typo should not pass silently.
    given = [(param, voice) for param, voice in (("audio.voice", req.audio.voice if req.audio else None),
                                                 ("speaker", req.speaker), ("voice", req.voice)) if voice is not None]
    for param, voice in given:
        if voice not in settings.voices:
            raise FrontendError(400, f"unknown voice {voice!r}; valid voices: {', '.join(settings.voices)}",
                                param=param, code="invalid_voice")  # fmt: skip
    return given[0][1] if given else settings.default_voice


def _sampling(values: Sampling, prefix: str) -> dict[str, Any]:
    return {
        prefix + name: getattr(values, name)
        for name in _SAMPLING_FIELDS
        if name in values.model_fields_set and getattr(values, name) is not None
    }
