# What the operator chose when starting the frontend; attached to the app as `app.state.settings`.
from __future__ import annotations

import time
from dataclasses import dataclass, field

DEFAULT_VOICES = ("chelsie", "ethan", "aiden")  # Qwen3-Omni's speaker table; serve passes the checkpoint's own
RESPONSE_STYLES = ("openai", "vllm-omni")
MiB = 1 << 20


@dataclass(frozen=True)
class FrontendSettings:
    model_name: str = "qwen3-omni"  # the `model` clients send and see in responses
    default_voice: str = "ethan"
    voices: tuple[str, ...] = DEFAULT_VOICES  # lower case, in the order error messages list them
    response_style: str = "openai"  # when a request does not choose one
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    max_body_bytes: int = 64 * MiB  # larger request bodies get 413
    # http(s) image/audio URLs in messages: fetched by the frontend only when enabled
    fetch_remote_media: bool = False
    fetch_timeout_s: float = 10.0
    fetch_max_bytes: int = 20 * MiB
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models `created`

    def __post_init__(self) -> None:
        voices = tuple(v.strip().lower() for v in self.voices if v.strip())
        object.__setattr__(self, "voices", voices)
        object.__setattr__(self, "default_voice", self.default_voice.strip().lower())
        if not voices:
            raise ValueError("voices must not be empty")
        if self.default_voice not in voices:
            raise ValueError(f"default_voice must be one of {', '.join(voices)}, got {self.default_voice!r}")
        if self.response_style not in RESPONSE_STYLES:
            raise ValueError(f"response_style must be one of {', '.join(RESPONSE_STYLES)}, got {self.response_style!r}")
        if self.max_body_bytes < 1024 or self.fetch_max_bytes < 1 or self.fetch_timeout_s <= 0:
            raise ValueError("size limits and timeouts must be positive (max_body_bytes >= 1 KiB)")
