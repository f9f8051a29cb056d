"""The API-key check shared by the HTTP middleware (``/v1`` routes) and the
``/v1/realtime`` WebSocket handshake."""

from __future__ import annotations

import hmac


def api_key_ok(authorization: str, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>``, compared in
    constant time. No key configured: every request passes."""
    if not api_key:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())
