"""The bytes of request bodies being read at once, across every request (``BodyBudget``).

``max_pending_requests`` counts a request only once its body is parsed, and each body
may be ``max_body_bytes``: without this bound, many slow uploads would hold their bodies
in the API process all at once. ``GuardMiddleware`` takes a request's declared
``Content-Length`` before reading a byte of it (a body without one is taken chunk by chunk
as it streams in) and gives it back once the body is read (it is then one of the pending
requests) or the request ends. A request that does not fit gets 503 with ``Retry-After``.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from epd.api.protocol import error_response

__all__ = ["BodyBudget", "BodyBudgetFull", "budget_full"]


def budget_full(limit_bytes: int) -> JSONResponse:
    """The 503 (with ``Retry-After``) for a body that does not fit a ``limit_bytes`` budget now."""
    return error_response(503, f"this body does not fit the request bodies the server may read at once "
                               f"({limit_bytes} bytes, --max-inflight-body-mb); retry later")


class BodyBudgetFull(Exception):
    """A streamed body (no ``Content-Length``) passed what the budget had left."""


class BodyBudget:
    """``limit_bytes`` of request bodies in flight at once; ``used``: bytes taken now.

    Used from the event loop only (no locking)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"the in-flight body budget must be >= 1 byte, got {limit_bytes}")
        self.limit, self.used = int(limit_bytes), 0

    def take(self, nbytes: int) -> bool:
        """Take ``nbytes`` (>= 0) if they fit; False (nothing taken) if not."""
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken earlier."""
        self.used -= nbytes
