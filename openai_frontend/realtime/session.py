# A session's configuration: defaults, `session.update` validated as a whole (a refused update changes
# nothing), and the `session` object that session.created / session.updated show.
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from omnistage.core.errors import BadRequestError
from omnistage.core.voices import normalize_voice

from openai_frontend.openai_voices import openai_voice
from openai_frontend.realtime.audio import FORMAT_RATES
from openai_frontend.realtime.events import EventError, field as get
from openai_frontend.realtime.tools import check_choice, function_tools, prompt_tools, tool_choice
from openai_frontend.schemas import StageSampling
from openai_frontend.settings import FrontendSettings

MAX_OUTPUT_TOKENS = 4096  # OpenAI's cap for max_output_tokens; "inf" means the thinker's own limit
SERVER_VAD_DEFAULTS = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                       "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}  # fmt: skip
SEMANTIC_VAD_DEFAULTS = {"type": "semantic_vad", "eagerness": "auto", "create_response": True,
                         "interrupt_response": True}  # fmt: skip
# semantic_vad is served by the server VAD, as voice-agent frameworks ask for it by default (LiveKit's OpenAI
# plugin does): there is no end-of-turn model to wait out an unfinished sentence (OpenAI's waits up to 8 / 4 /
# 2 s at low / medium / high), so eagerness sets how long a silence ends the turn
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 300}
# accepted and shown as off: clients (voice-agent frameworks) send them by default, and the model has no
# separate transcriber or denoiser to honour them
ACCEPTED_OFF = {"transcription", "noise_reduction"}
# no effect on this model; echoed as given, as GA clients send them in every update (parallel_tool_calls: the
# model may write several calls, and every one is returned)
_IGNORED = {"tracing", "truncation", "include", "prompt", "parallel_tool_calls", "reasoning"}
_SESSION_KEYS = {"type", "model", "instructions", "output_modalities", "audio", "max_output_tokens", "tools",
                 "tool_choice", "sampling_params_list", *_IGNORED}  # fmt: skip


@dataclass
class SessionConfig:
    voice: str  # as the client named it, echoed back
    speaker: str  # the checkpoint voice that speaks it (openai_voices.py)
    model: str
    instructions: str = ""
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: dict[str, Any] | None = field(default_factory=lambda: dict(SERVER_VAD_DEFAULTS))
    max_output_tokens: int | str = "inf"
    sampling_params_list: list[dict[str, Any] | None] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # function tools as the client gave them (tools.py)
    tool_choice: str | dict[str, str] = "auto"
    echoed: dict[str, Any] = field(default_factory=dict)  # _IGNORED fields as the client set them

    @classmethod
    def default(cls, settings: FrontendSettings) -> SessionConfig:
        return cls(voice=settings.default_voice, speaker=settings.default_voice, model=settings.model_for(None))

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers (chat format); with any, the reply's <tool_call> blocks become calls."""
        return prompt_tools(self.tools, self.tool_choice)

    def updated(self, session: Any, settings: FrontendSettings) -> SessionConfig:
        """A copy with `session` (the event's object) applied; EventError names the first bad field."""
        if not isinstance(session, dict):
            raise EventError("'session' must be an object", code="invalid_type", param="session")
        new = copy.deepcopy(self)
        for key in session:
            if key not in _SESSION_KEYS:
                raise EventError(f"unknown parameter 'session.{key}'", code="unknown_parameter", param=f"session.{key}")
        if session.get("type", "realtime") != "realtime":
            raise EventError("only 'realtime' sessions are served (no transcription sessions)",
                             param="session.type")  # fmt: skip
        model = get(session, "model", str, required=False, where="session.")
        if model is not None and model not in settings.served_model_names:
            raise EventError(settings.unknown_model(model), code="model_not_found", param="session.model")
        if "instructions" in session:
            new.instructions = get(session, "instructions", str, required=False, where="session.") or ""
        if "output_modalities" in session:
            new.output_modalities = _modalities(session["output_modalities"])
        if session.get("tools") is not None:
            new.tools = function_tools(session["tools"], "session.tools")
        if session.get("tool_choice") is not None:
            new.tool_choice = tool_choice(session["tool_choice"], "session.tool_choice")
        check_choice(new.tools, new.tool_choice, "session.tool_choice")
        if "max_output_tokens" in session:
            new.max_output_tokens = max_output_tokens(session["max_output_tokens"], "session.max_output_tokens")
        if "sampling_params_list" in session:
            new.sampling_params_list = sampling_params_list(session["sampling_params_list"])
        new.echoed.update({k: session[k] for k in _IGNORED if k in session})
        audio = get(session, "audio", dict, required=False, where="session.") or {}
        for key in audio:
            if key not in ("input", "output"):
                raise EventError(f"unknown parameter 'session.audio.{key}'", code="unknown_parameter",
                                 param=f"session.audio.{key}")  # fmt: skip
        _apply_input(new, get(audio, "input", dict, required=False, where="session.audio.") or {})
        _apply_output(new, get(audio, "output", dict, required=False, where="session.audio.") or {}, settings)
        return new

    def public(self, session_id: str) -> dict[str, Any]:
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {
                "input": {"format": audio_format(self.input_format),
                          "turn_detection": shown_turn_detection(self.turn_detection),
                          "transcription": None, "noise_reduction": None},
                "output": {"format": audio_format(self.output_format), "voice": self.voice, "speed": 1.0},
            },
            "max_output_tokens": self.max_output_tokens, "tools": copy.deepcopy(self.tools),
            "tool_choice": copy.deepcopy(self.tool_choice), "tracing": None,
            "truncation": "disabled", "expires_at": 0, "sampling_params_list": self.sampling_params_list,
            **self.echoed,
        }  # fmt: skip


def audio_format(fmt: str) -> dict[str, Any]:
    return {"type": fmt, "rate": FORMAT_RATES[fmt]} if fmt == "audio/pcm" else {"type": fmt}


def _modalities(value: Any, param: str = "session.output_modalities") -> list[str]:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise EventError("output_modalities must be [\"audio\"] or [\"text\"]", param=param)
    return ["audio"] if "audio" in value else ["text"]  # audio always comes with its transcript


def max_output_tokens(value: Any, param: str) -> int | str:
    if value == "inf":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise EventError(f"max_output_tokens must be an integer in 1..{MAX_OUTPUT_TOKENS} or \"inf\"", param=param)
    return value


def sampling_params_list(value: Any) -> list[dict[str, Any] | None] | None:
    """vLLM-Omni's [thinker, talker, code2wav] sampling entries, checked like the chat API's."""
    param = "session.sampling_params_list"
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 3:
        raise EventError("sampling_params_list must be a list of at most 3 entries (thinker, talker, code2wav)",
                         param=param)  # fmt: skip
    out = []
    for i, entry in enumerate(value):
        if entry is None:
            out.append(None)
            continue
        try:
            stage = StageSampling.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise EventError(f"{param}[{i}].{where}: {first['msg']}", param=f"{param}[{i}].{where}") from None
        out.append(stage.model_dump(exclude_none=True, exclude={"detokenize", "skip_special_tokens",
                                                                 "spaces_between_special_tokens"}))  # fmt: skip
    return out


def format_from_client(value: Any, param: str) -> str:
    if not isinstance(value, dict) or value.get("type") not in FORMAT_RATES:
        raise EventError(f"{param}.type must be one of {', '.join(FORMAT_RATES)}", param=f"{param}.type")
    if value["type"] == "audio/pcm" and value.get("rate", 24000) != 24000:
        raise EventError("audio/pcm is 24000 Hz", param=f"{param}.rate")
    return value["type"]


def _apply_input(new: SessionConfig, audio_in: dict[str, Any]) -> None:
    where = "session.audio.input"
    for key in audio_in:
        if key not in ("format", "turn_detection", *ACCEPTED_OFF):
            raise EventError(f"unknown parameter '{where}.{key}'", code="unknown_parameter", param=f"{where}.{key}")
    if "format" in audio_in:
        new.input_format = format_from_client(audio_in["format"], f"{where}.format")
    if "turn_detection" in audio_in:
        new.turn_detection = turn_detection(audio_in["turn_detection"], f"{where}.turn_detection")


def _apply_output(new: SessionConfig, audio_out: dict[str, Any], settings: FrontendSettings) -> None:
    where = "session.audio.output"
    for key in audio_out:
        if key not in ("format", "voice", "speed"):
            raise EventError(f"unknown parameter '{where}.{key}'", code="unknown_parameter", param=f"{where}.{key}")
    if "format" in audio_out:
        new.output_format = format_from_client(audio_out["format"], f"{where}.format")
    if "voice" in audio_out:
        new.voice, new.speaker = voice(audio_out["voice"], settings, f"{where}.voice")
    if audio_out.get("speed", 1.0) != 1.0:
        raise EventError("only speed 1.0 is supported", code="unsupported", param=f"{where}.speed")


def voice(value: Any, settings: FrontendSettings, param: str) -> tuple[str, str]:
    """(the name to echo, the checkpoint voice that speaks it): the checkpoint's voices, and OpenAI's built-in
    names, which voice-agent clients send by default, spoken in the default voice."""
    name = value.get("id") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise EventError(f"unknown voice {name!r}; valid voices: {', '.join(settings.voices)}", code="invalid_voice",
                         param=param)  # fmt: skip
    try:
        return normalize_voice(name), openai_voice(name, settings, param)  # the one voice check of every layer
    except BadRequestError as e:
        raise EventError(str(e), code="invalid_voice", param=param) from None


def turn_detection(value: Any, param: str) -> dict[str, Any] | None:
    """The server VAD's settings (SERVER_VAD_DEFAULTS' keys), with semantic_vad's own when it was asked for."""
    if value is None:
        return None  # manual: the client commits the buffer and asks for responses itself
    if not isinstance(value, dict):
        raise EventError(f"{param} must be an object or null", param=param)
    kind = value.get("type", "server_vad")
    if kind == "semantic_vad":
        return _semantic_vad(value, param)
    if kind != "server_vad":
        raise EventError(f"{param}.type must be 'server_vad' or 'semantic_vad'", param=f"{param}.type")
    out = _vad_settings(value, SERVER_VAD_DEFAULTS, param)
    if out["idle_timeout_ms"] is not None:
        raise EventError(f"{param}.idle_timeout_ms is not supported", code="unsupported", param=f"{param}.idle_timeout_ms")
    return out


def _semantic_vad(value: dict[str, Any], param: str) -> dict[str, Any]:
    out = _vad_settings(value, SEMANTIC_VAD_DEFAULTS, param)
    return {**SERVER_VAD_DEFAULTS, "silence_duration_ms": EAGERNESS_SILENCE_MS[out["eagerness"]], **out}


def _vad_settings(value: dict[str, Any], defaults: dict[str, Any], param: str) -> dict[str, Any]:
    """`defaults` with the client's settings over them, each checked; a key not in `defaults` is refused."""
    out = dict(defaults)
    for key, item in value.items():
        if key not in out:
            raise EventError(f"unknown parameter '{param}.{key}'", code="unknown_parameter", param=f"{param}.{key}")
        if item is None:
            continue
        if key == "threshold":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.0 <= item <= 1.0:
                raise EventError(f"{param}.threshold must be a number in 0..1", param=f"{param}.threshold")
        elif key in ("prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= 10_000:
                raise EventError(f"{param}.{key} must be an integer in 0..10000", param=f"{param}.{key}")
        elif key == "eagerness" and not (isinstance(item, str) and item in EAGERNESS_SILENCE_MS):
            raise EventError(f"{param}.eagerness must be one of {', '.join(EAGERNESS_SILENCE_MS)}",
                             param=f"{param}.eagerness")  # fmt: skip
        elif key in ("create_response", "interrupt_response") and not isinstance(item, bool):
            raise EventError(f"{param}.{key} must be a boolean", code="invalid_type", param=f"{param}.{key}")
        out[key] = item
    return out


def shown_turn_detection(td: dict[str, Any] | None) -> dict[str, Any] | None:
    """The turn detection as the client set it: semantic_vad shows its own fields, not the server VAD's."""
    if td is None:
        return None
    return {k: td[k] for k in (SEMANTIC_VAD_DEFAULTS if td["type"] == "semantic_vad" else SERVER_VAD_DEFAULTS)}
