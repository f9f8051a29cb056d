"""Data plane: moving KV blocks and embeddings between workers with NIXL.

`nixl_transport.NixlTransport` wraps one NIXL agent per worker process. Descriptor
tables cross the control plane as plain integer triples (``epd.messages.Region``,
checked in ``regions``); nothing received from a peer is ever unpickled, and every
remote range is checked against the regions the peer advertised before NIXL sees it.
The KV connector: ``kv_connector`` (its interfaces), ``kv_sender`` / ``kv_receiver``
(prefill / decode sides), ``kv_runner`` (each TP rank's side), ``rank_agent`` (per-rank
agents), ``staging`` (the staging pool).
"""

from epd.transfer.nixl_transport import (
    NixlTransport,
    Transfer,
    TransferError,
    TransferTimeout,
)

__all__ = ["NixlTransport", "Transfer", "TransferError", "TransferTimeout"]
