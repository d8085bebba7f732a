# The plan of one chat request: a parsed ChatCompletionRequest resolved into what one `omni_ensemble`
# request needs, all decided here once: the model name the response carries, the voice, the messages as
# the prompt reads them (earlier spoken replies resolved, tools rendered, media readied by media_inputs.py),
# the flat request parameters (omnistage.core.protocol.OMNI.parameters) and how to shape the response.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.core.voices import resolve_voice

from openai_frontend.audio_store import AudioStore
from openai_frontend.errors import FrontendError
from openai_frontend.media_inputs import prepare_messages
from openai_frontend.openai_voices import openai_voice
from openai_frontend.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Sampling
from openai_frontend.settings import FrontendSettings
from openai_frontend.tool_calls import offered_tools, prompt_messages

_SAMPLING_FIELDS = tuple(Sampling.model_fields)
_STAGE_PREFIX = ("", "talker_")  # sampling_params_list index -> OMNI parameter prefix; code2wav has none


@dataclass(frozen=True)
class ChatPlan:
    model: str  # the served name the response carries: the one the request sent
    messages: list[dict[str, Any]]
    parameters: dict[str, Any]
    text_out: bool  # reply text in message.content / delta.content
    audio_out: bool
    audio_format: str  # audio_encoding.FORMATS
    stream: bool
    include_usage: bool
    response_style: str = "openai"  # settings.RESPONSE_STYLES
    stop: tuple[str, ...] = ()  # stop strings, matched on the reply text
    tools: bool = False  # <tool_call> blocks of the reply are returned as tool_calls (tool_calls.py)


def served_model(requested: str | None, settings: FrontendSettings) -> str:
    if requested is not None and requested not in settings.served_model_names:
        raise FrontendError(404, settings.unknown_model(requested), param="model", code="model_not_found")
    return settings.model_for(requested)


async def plan_chat(req: ChatCompletionRequest, settings: FrontendSettings, audio: AudioStore | None = None) -> ChatPlan:
    model = served_model(req.model, settings)
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
    kwargs = req.mm_processor_kwargs
    if req.use_audio_in_video or (kwargs is not None and kwargs.use_audio_in_video):
        parameters["use_audio_in_video"] = True

    tools = _offered_tools(req)
    return ChatPlan(
        model=model,
        messages=await prepare_messages(prompt_messages(_resolve_audio(req.messages, audio), tools), settings),
        parameters=parameters,
        text_out=text_out,
        audio_out=audio_out,
        audio_format=req.audio.format if req.audio else "wav",
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        response_style=req.response_style or settings.response_style,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        tools=bool(tools),
    )


def _voice(req: ChatCompletionRequest, settings: FrontendSettings) -> str:
    # OpenAI's audio.voice first (OpenAI's built-in names too: openai_voices.py), then vLLM-Omni's top-level
    # speaker / voice. Every one given must exist, used or not: a typo should not pass silently.
    asked = req.audio.voice if req.audio else None
    resolved = [openai_voice(asked, settings, "audio.voice")] if asked is not None else []
    resolved += [resolve_voice(voice, settings.voices, param=param)
                 for param, voice in (("speaker", req.speaker), ("voice", req.voice)) if voice is not None]  # fmt: skip
    return resolved[0] if resolved else settings.default_voice


def _offered_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    if isinstance(req.tool_choice, NamedToolChoice):
        return offered_tools(tools, None, req.tool_choice.function.name)
    return offered_tools(tools, req.tool_choice)


def _resolve_audio(messages: list[ChatMessage], audio: AudioStore | None) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        m = message.model_dump(exclude_unset=True, exclude_none=True)
        if message.audio is not None:
            kept = audio.get(message.audio.id) if audio is not None else None
            if kept is None:
                raise FrontendError(400, f"messages[{i}].audio.id {message.audio.id!r} is unknown or has expired; "
                                    "send the reply's transcript as content instead",
                                    param=f"messages[{i}].audio.id", code="audio_not_found")  # fmt: skip
            m.pop("audio")
            m["content"] = kept.transcript if m.get("content") is None else m["content"]
        out.append(m)
    return out


def _sampling(values: Sampling, prefix: str) -> dict[str, Any]:
    return {
        prefix + name: getattr(values, name)
        for name in _SAMPLING_FIELDS
        if name in values.model_fields_set and getattr(values, name) is not None
    }
