# Request bodies of the OpenAI endpoints, validated by pydantic (strict: "0.5" is not a float).
# Messages are checked for shape only and forwarded as sent; the ensemble interprets them.
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from openai_frontend.settings import RESPONSE_STYLES

AUDIO_FORMAT_ALIASES = {"wav": "wav", "pcm": "pcm", "pcm16": "pcm", "flac": "flac", "mp3": "mp3", "opus": "opus"}
MODALITIES = ("text", "audio")  # a request may ask for either or both
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's limit on stop strings
INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


# ---- messages -------------------------------------------------------------------------------------------
# Content parts the ensemble understands: part type -> required string fields of its payload object
# (None: the payload itself is the string).
CONTENT_PARTS = {
    "text": None,
    "image_url": ("url",),
    "input_audio": ("data", "format"),
    "audio_url": ("url",),
    "video_url": ("url",),
}


def check_content(content: Any) -> Any:
    """A string, or a non-empty list of content parts; returned unchanged (forwarded as sent)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError("content must be a string or a non-empty list of content parts")
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in CONTENT_PARTS:  # a dict `type` is unhashable: no `in`
            raise ValueError(f"content[{i}].type must be one of {', '.join(CONTENT_PARTS)}, got {kind!r}")
        payload, fields = part.get(kind), CONTENT_PARTS[kind]
        if fields is None:
            ok = isinstance(payload, str)
        else:
            ok = isinstance(payload, dict) and all(isinstance(payload.get(f), str) for f in fields)
        if not ok:
            shape = "a string" if fields is None else "an object with string " + ", ".join(fields)
            raise ValueError(f"content[{i}].{kind} must be {shape}")
    return content


def _part_schema(kind: str, fields: tuple[str, ...] | None) -> dict[str, Any]:
    payload = {"type": "string"} if fields is None else {
        "type": "object", "required": list(fields), "properties": {f: {"type": "string"} for f in fields}}
    return {"type": "object", "required": ["type", kind], "properties": {"type": {"const": kind}, kind: payload}}


# What check_content accepts, for the OpenAPI schema (docs, and schema-based fuzzing of valid requests)
CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1, "items": {"anyOf": [_part_schema(k, f) for k, f in CONTENT_PARTS.items()]}},
]}  # fmt: skip


def check_unicode(value: Any) -> Any:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 encoder (and so no tokenizer) takes."""
    if isinstance(value, str):
        if value.isascii():  # most text, and every base64 payload: no copy made
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("invalid Unicode: a lone surrogate (\\ud800-\\udfff) outside a pair") from None
    elif isinstance(value, dict):
        for key, item in value.items():  # keys too: an open object (tool parameters) is forwarded whole
            check_unicode(key)
            check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            check_unicode(item)
    return value


class ToolCallFunction(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AudioRef(_Strict):
    id: str  # the `audio.id` of an earlier spoken reply of this server (audio_store.py)


class ChatMessage(_Open):
    role: Literal[ROLES]  # type: ignore[valid-type]
    # None: an assistant turn given by its tool_calls or its earlier audio instead
    content: Annotated[Any, WithJsonSchema(CONTENT_SCHEMA)] = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    audio: AudioRef | None = None  # assistant: OpenAI's multi-turn audio

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return None if value is None else check_content(value)

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.audio)):
            raise ValueError("content is required (an assistant message may give tool_calls or audio instead)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, value: Any) -> Any:  # every field: content, name and any extra one are forwarded
        return check_unicode(value)


class FunctionDef(_Open):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class ResponseFormat(_Open):
    type: str


# ---- audio output ---------------------------------------------------------------------------------------
def check_voice(value: Any) -> str | None:
    # Only the shape here; whether the voice exists depends on the served checkpoint (chat_params.py).
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:  # OpenAI's custom-voice form {"id": ...}
        value = value["id"]
    if not isinstance(value, str):
        raise ValueError("voice must be a string")
    return value.strip().lower()


class AudioOptions(_Strict):
    voice: Any = None
    format: str = "wav"

    _voice = field_validator("voice", mode="before")(check_voice)

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> str:
        if not isinstance(value, str) or value.strip().lower() not in AUDIO_FORMAT_ALIASES:
            supported = ", ".join(AUDIO_FORMAT_ALIASES)
            raise ValueError(f"unsupported audio format {value!r}; supported: {supported}")
        return AUDIO_FORMAT_ALIASES[value.strip().lower()]


class MMProcessorKwargs(_Open):
    """vLLM-Omni's per-request preprocessing options; only use_audio_in_video changes anything here."""

    use_audio_in_video: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage still comes once at the end


# ---- sampling -------------------------------------------------------------------------------------------
class Sampling(_Strict):
    """The engine's sampling fields; names equal `omnistage.core.protocol.SAMPLING_PARAMETERS`."""

    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None


class StageSampling(Sampling):
    """One entry of vLLM-Omni's `sampling_params_list` ([thinker, talker, code2wav])."""

    # vLLM SamplingParams fields that change nothing here; accepted so vLLM-Omni clients work as they are
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None


# ---- /v1/chat/completions --------------------------------------------------------------------------------
class ChatCompletionRequest(Sampling):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI fields we do not use are tolerated

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    modalities: Annotated[list[Literal[MODALITIES]], Field(min_length=1, max_length=2, json_schema_extra={"uniqueItems": True})] | None = None  # type: ignore[valid-type]  # noqa: E501
    audio: AudioOptions | None = None
    speaker: Any = None  # vLLM-Omni's top-level voice fields
    voice: Any = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    sampling_params_list: Annotated[list[StageSampling | None], Field(max_length=3)] | None = None
    # video parts bring their audio track, interleaved with the frames (top level or vLLM-Omni's kwargs)
    use_audio_in_video: bool | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # "openai" (choices[0].message.audio / delta.audio) or "vllm-omni" (`modality` chunks, WAV per chunk);
    # None: the server's --response-style
    response_style: Literal[RESPONSE_STYLES] | None = None  # type: ignore[valid-type]
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    # OpenAI fields whose silent omission would change the answer: accepted only at their no-op value
    n: int | None = None
    logprobs: bool | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # the model may write several blocks; all are returned

    _voices = field_validator("speaker", "voice", mode="before")(check_voice)

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        # Every field is forwarded or rendered into the prompt (tool descriptions and parameters too), and a
        # lone surrogate fails to encode only there; messages are checked one by one (ChatMessage) to name
        # the message. Fields this model does not know are dropped, so they are not checked.
        if isinstance(value, dict):
            for key, item in value.items():
                if key in cls.model_fields and key != "messages":
                    try:
                        check_unicode(item)
                    except ValueError as exc:
                        raise ValueError(f"{key}: {exc}") from None
        return value

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or len(set(value)) != len(value)):
            raise ValueError(f"modalities must be a non-empty list of distinct values from {', '.join(MODALITIES)}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.n not in (None, 1):
            raise ValueError("n > 1 is not supported: send n requests (each streams its own audio)")
        if self.stop == "":
            raise ValueError("stop must be a non-empty string or a list of them")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported: replies are "
                             "free text (json_object and json_schema would need constrained decoding)")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self
