# The frontend's only view of the serving backend: one streamed request in, `OmniChunk`s out.
# TritonOmniClient (triton_client.py) implements it over gRPC; tests implement it with a scripted fake.
from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class OmniChunk:
    """One streamed response of `omni_ensemble`, decoded.

    The last chunk of a stream, and only that one, has `finish_reason` set ("stop" | "length" |
    "abort"); it may carry text and audio as well. `usage` is the backend's latest report, when it gives
    one: the prompt's part once the thinker started, the whole on the last chunk (openai_frontend/usage.py).
    """

    text: str = ""  # utf-8 text delta
    token_ids: list[int] = field(default_factory=list)  # the delta's token ids
    audio: np.ndarray | None = None  # [samples] float32, 24 kHz mono in [-1, 1]
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


class OmniClient(abc.ABC):
    """What the HTTP layer needs from the backend.

    `stream` is an async generator. Errors are raised as `omnistage.core.errors.OmniError`
    subclasses (BadRequestError -> 400, OverloadedError -> 503, EngineError -> 500); a caller that
    stops iterating early must `aclose()` the generator, which cancels the request in the backend.
    """

    @abc.abstractmethod
    def stream(
        self, messages: list[dict[str, Any]], parameters: dict[str, Any], *, request_id: str = ""
    ) -> AsyncIterator[OmniChunk]:
        """Start one request; `parameters` are `omnistage.core.protocol.OMNI.parameters` by name."""

    @abc.abstractmethod
    async def ready(self) -> bool:
        """True when a request sent now would be served."""

    async def start(self) -> None:
        """Start background work (health probes); called once at application startup."""

    def health_report(self) -> dict | None:
        """Details for /health (e.g. per-model state), or None."""
        return None

    async def close(self) -> None:
        """Release connections; called once at application shutdown."""
