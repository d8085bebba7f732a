# A validated ChatCompletionRequest resolved into what one `omni_ensemble` request needs: the messages,
# the flat request parameters (omnistage.core.protocol.OMNI.parameters) and how to shape the response.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    audio_format: str  # "wav" | "pcm"
    stream: bool
    include_usage: bool


def plan_chat(req: ChatCompletionRequest, settings: FrontendSettings) -> ChatPlan:
    modalities = req.modalities or ["text", "audio"]  # vLLM-Omni's default: text and speech
    text_out, audio_out = "text" in modalities, "audio" in modalities
    voice = (req.audio.voice if req.audio else None) or req.speaker or req.voice or settings.default_voice

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
    )


def _sampling(values: Sampling, prefix: str) -> dict[str, Any]:
    return {
        prefix + name: getattr(values, name)
        for name in _SAMPLING_FIELDS
        if name in values.model_fields_set and getattr(values, name) is not None
    }
