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
    retry_after_s = 1  # the frontend's Retry-After header


class StageUnavailableError(OmniError):
    """A stage cannot serve at all right now (its process died and is being reloaded)."""

    code = 503
    retry_after_s = 5  # a reload takes seconds


# What the Python backend answers for a model whose stub process died (Triton 2.51 neither restarts the
# stub nor marks the model unready): "Stub process '<instance>' is not healthy."
STUB_DEAD_MARK = "is not healthy"
PROBE_ACTION = "probe"  # request parameter action=probe: every model answers at once, proving its stub runs
