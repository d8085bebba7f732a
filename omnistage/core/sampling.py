# Per-request sampling parameters (torch-free) and their validation from Triton request parameters.
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from .errors import BadRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 2048  # thinker: reply tokens; talker: codec frames
    min_tokens: int = 0  # EOS is suppressed until this many were produced
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling) = off
    repetition_penalty: float = 1.0  # HF semantics, over the tokens this request generated
    presence_penalty: float = 0.0  # OpenAI semantics
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # max_tokens came with the request (else it is the stage default, cut to what the context has room for)
    max_tokens_given: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> "SamplingParams":
        # max_tokens has no upper bound of its own: what bounds it is the context (fit_to_context)
        checks = [
            (1 <= self.max_tokens, "max_tokens must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be >= -1 (0 or -1: off)"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 64-bit integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadRequestError(message, param=message.split()[0], code="invalid_value")
        return self

    def fit_to_context(self, prompt_tokens: int, context: int, stage: str = "") -> "SamplingParams":
        """vLLM's rule: a max_tokens the request gave is taken when prompt + max_tokens fits the context (else
        a 400 naming both numbers); a default one is cut to the room the prompt leaves. `stage` names a stage
        other than the thinker in the message and the param (`talker_max_tokens`)."""
        room = context - prompt_tokens
        whose, param = (f"the {stage}'s", f"{stage}_max_tokens") if stage else ("this server's", "max_tokens")
        if room < 1:
            raise BadRequestError(f"{whose if stage else 'the'} prompt has {prompt_tokens} tokens, more than "
                                  f"{whose} context of {context} tokens leaves room for", param="messages",
                                  code="context_length_exceeded")  # fmt: skip
        if not self.max_tokens_given:
            return replace(self, max_tokens=min(self.max_tokens, room))
        if self.max_tokens > room:
            raise BadRequestError(
                f"{param} is too large: {self.max_tokens}. {whose.capitalize()} context is {context} tokens and the "
                f"prompt has {prompt_tokens} ({prompt_tokens} + {self.max_tokens} > {context})",
                param=param, code="context_length_exceeded")
        return self


def coerce_parameter(name: str, kind: type, value):
    if name == "stop_token_ids":
        ids = json.loads(value) if isinstance(value, str) else value
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequestError("stop_token_ids must be a list of integers")
        return tuple(ids)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise BadRequestError(f"{name} must be a boolean")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise BadRequestError(f"{name} must be an integer")
        try:
            return int(value)
        except ValueError:
            raise BadRequestError(f"{name} must be an integer") from None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BadRequestError(f"{name} must be a number") from None


_FIELD_KINDS = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float,
    "seed": int, "ignore_eos": bool, "stop_token_ids": list,
}  # fmt: skip


def sampling_from_parameters(parameters: dict, defaults: SamplingParams, prefix: str = "") -> SamplingParams:
    """Reads `<prefix><field>` entries of a request-parameter dict over `defaults`; unknown keys are ignored
    here (the caller owns the whole parameter namespace)."""
    updates = {}
    for name, kind in _FIELD_KINDS.items():
        key = prefix + name
        if key in parameters and parameters[key] is not None:
            try:
                updates[name] = coerce_parameter(key, kind, parameters[key])
            except BadRequestError as e:
                raise BadRequestError(str(e), param=key, code="invalid_type") from None
    if "max_tokens" in updates:
        updates["max_tokens_given"] = True
    return replace(defaults, **updates).validate()
