"""Data plane: moving KV blocks and embeddings between workers with NIXL.

`nixl_transport.NixlTransport` wraps one NIXL agent per worker process. Descriptor
tables cross the control plane as plain integer triples (addr, nbytes, device_id);
nothing received from a peer is ever unpickled, and every remote range is checked
against the regions the peer advertised before NIXL sees it.
"""

from epd.transfer.nixl_transport import (
    NixlTransport,
    Region,
    Transfer,
    TransferError,
    TransferTimeout,
)

__all__ = ["NixlTransport", "Region", "Transfer", "TransferError", "TransferTimeout"]
