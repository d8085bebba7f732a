# What the operator chose when starting the frontend; attached to the app as `app.state.settings`.
from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field

from omnistage.core.voices import DEFAULT_VOICE, normalize_voice

DEFAULT_VOICES = ("chelsie", "ethan", "aiden")  # Qwen3-Omni's speaker table; serve passes the checkpoint's own
RESPONSE_STYLES = ("openai", "vllm-omni")
# the name vLLM-Omni's clients send, then the short one; whatever checkpoint is loaded
SERVED_MODEL_NAMES = ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni")
MiB = 1 << 20


@dataclass(frozen=True)
class FrontendSettings:
    # the `model` values clients may send; a response names the one its request sent (else the first)
    served_model_names: tuple[str, ...] = SERVED_MODEL_NAMES
    default_voice: str = DEFAULT_VOICE
    voices: tuple[str, ...] = DEFAULT_VOICES  # lower case, in the order error messages list them
    response_style: str = "openai"  # when a request does not choose one
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    max_body_bytes: int = 64 * MiB  # larger request bodies get 413
    # http(s) image/audio URLs in messages: fetched by the frontend only when enabled
    fetch_remote_media: bool = False
    fetch_timeout_s: float = 10.0
    fetch_max_bytes: int = 20 * MiB
    # spoken replies' transcripts kept for multi-turn audio (audio_store.py): how long, how many, how many bytes
    audio_keep_s: int = 3600
    audio_keep_count: int = 1024
    audio_keep_bytes: int = 64 * MiB
    # networks (CIDR) a fetch may reach beyond public addresses, e.g. an internal media store
    fetch_allowed_networks: tuple[str, ...] = ()
    # compressed input audio is decoded here; longer is a 400 (serve passes the profile's max_audio_seconds)
    max_audio_seconds: float = 600.0
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models `created`

    def __post_init__(self) -> None:
        voices = tuple(normalize_voice(v) for v in self.voices if v.strip())
        object.__setattr__(self, "voices", voices)
        object.__setattr__(self, "default_voice", normalize_voice(self.default_voice))
        if not self.served_model_names or not all(n.strip() for n in self.served_model_names):
            raise ValueError("served_model_names must be non-empty names")
        if not voices:
            raise ValueError("voices must not be empty")
        if self.default_voice not in voices:
            raise ValueError(f"default_voice must be one of {', '.join(voices)}, got {self.default_voice!r}")
        if self.response_style not in RESPONSE_STYLES:
            raise ValueError(f"response_style must be one of {', '.join(RESPONSE_STYLES)}, got {self.response_style!r}")
        if self.audio_keep_s < 1 or self.audio_keep_count < 0 or self.audio_keep_bytes < 0:
            raise ValueError("audio_keep_s must be positive, audio_keep_count and audio_keep_bytes not negative")
        if self.max_body_bytes < 1024 or self.fetch_max_bytes < 1 or self.fetch_timeout_s <= 0 or self.max_audio_seconds <= 0:
            raise ValueError("size limits and timeouts must be positive (max_body_bytes >= 1 KiB)")
        try:
            ipaddress_networks = tuple(ipaddress.ip_network(n, strict=False) for n in self.fetch_allowed_networks)
        except ValueError as exc:
            raise ValueError(f"fetch_allowed_networks: {exc}") from None
        object.__setattr__(self, "fetch_allowed_networks", tuple(str(n) for n in ipaddress_networks))

    def unknown_model(self, requested: str) -> str:
        """The message for a model this server does not serve; a long name is cut, since it is the client's."""
        shown = requested if len(requested) <= 80 else requested[:80] + "..."
        return f"model {shown!r} not found; this server serves {', '.join(repr(n) for n in self.served_model_names)}"

    def model_for(self, requested: str | None) -> str:
        """The name a response carries; an unknown one is a 404 (raised by the caller)."""
        return self.served_model_names[0] if requested is None else requested
