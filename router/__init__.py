"""Routing, pool registry and request state machine (epd.router)."""
