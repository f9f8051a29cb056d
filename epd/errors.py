"""Errors a caller can act on. Each message says what was wrong and how to fix it."""


class InvalidRequestError(ValueError):
    """A request was rejected before it ran (empty prompt, too long, bad parameter).

    ``param`` names the offending field when there is one (OpenAI's error ``param``).
    Other requests are not affected.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(RuntimeError):
    """No room for the request right now (a full buffer or pool); another instance, or
    the same one a moment later, may have room: HTTP 503 with ``Retry-After``."""


class InternalError(RuntimeError):
    """epd's own fault (a worker's state or configuration), not the request's: HTTP 500."""


def error_status(exc: BaseException) -> int:
    """The HTTP status a failure maps to, by who failed: 400 the client's request
    (``InvalidRequestError``, which ``epd.encoders.media_limits.MediaError`` is too),
    503 capacity (``CapacityError``), 500 anything else, a plain ``ValueError`` included
    (an internal check failing is epd's fault, never the client's)."""
    if isinstance(exc, CapacityError):
        return 503
    if isinstance(exc, InvalidRequestError):
        return 400
    return 500
