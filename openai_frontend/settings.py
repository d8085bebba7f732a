# What the operator chose when starting the frontend; attached to the app as `app.state.settings`.
from __future__ import annotations

import time
from dataclasses import dataclass, field

from openai_frontend.schemas import VOICES


@dataclass(frozen=True)
class FrontendSettings:
    model_name: str = "qwen3-omni"  # the `model` clients send and see in responses
    default_voice: str = "ethan"
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models `created`

    def __post_init__(self) -> None:
        if self.default_voice not in VOICES:
            raise ValueError(f"default_voice must be one of {', '.join(VOICES)}, got {self.default_voice!r}")
