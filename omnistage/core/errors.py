# Typed errors of the core. They are mapped once to Triton errors (omnistage/triton) and once to
# OpenAI's error envelope (openai_frontend), including mid-stream.


class OmniError(Exception):
    """Base class; `code` is the HTTP status a client should see."""

    code = 500


class BadRequestError(OmniError):
    """The request is invalid; nothing was started for it."""

    code = 400


class EngineError(OmniError):
    """The engine failed while serving an accepted request."""

    code = 500


class OverloadedError(OmniError):
    """The stage cannot accept more work right now (queue full)."""

    code = 503
