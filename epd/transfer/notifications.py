"""The NIXL notifications that reached a worker's agent, decoded as ``epd.messages`` structs.

Every worker reads its notifications here (the decode side's ``KVReady`` / ``KVWriterDone``
/ ``KVWriterFenced``, an encoder's ``ReleaseEmbeddings``, remote prefix reads'
``PrefixPin`` / ``PrefixPinned`` / ``PrefixUnpin``): each is one message decoded with
``epd.messages.decode``, never unpickled; a malformed one is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from epd.messages import Message, MessageError, decode

logger = logging.getLogger(__name__)

__all__ = ["decoded_notifs"]


def decoded_notifs(transport) -> Iterator[tuple[str, Message]]:
    """(sender agent, message) for each notification ``transport.get_notifs()`` hands
    over (``NixlTransport``: per sender, in arrival order)."""
    for peer, raws in transport.get_notifs().items():
        for raw in raws:
            try:
                yield peer, decode(raw)
            except MessageError as e:
                logger.warning("%s: bad notification from %s: %s", getattr(transport, "name", "?"), peer, e)
