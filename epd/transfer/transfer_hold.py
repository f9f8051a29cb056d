"""The hold seam of :class:`~epd.transfer.nixl_transport.NixlTransport`, for tests of
transfers in flight.

On CPU, UCX completes a transfer inside its post, so no test could see a release race
without it. While ``hold`` is True, or the file named by ``$EPD_INJECT_HOLD_TRANSFERS``
exists, new transfers stay in flight ("PROC") without reaching NIXL, and releasing one
cannot cancel it; once the hold ends they are handed to NIXL in posting order and land,
as the worst case of NIXL's own semantics (``release_xfer_handle`` of an unfinished
transfer only starts its abort). Each held transfer appends a line to
``$EPD_INJECT_HOLD_TRANSFERS.held`` (so a test knows it is in flight). A ``{agent}`` in
the path is replaced by the agent's name (a worker's instance id).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd.transfer.nixl_transport import Transfer

logger = logging.getLogger(__name__)


class TransferHold:
    """Mixin of NixlTransport: ``hold`` (bool) and the transfers it holds, in posting order."""

    name: str
    _agent: Any
    _live: Any

    def _init_hold(self, name: str) -> None:
        self.hold = False
        self._hold_path = os.environ.get("EPD_INJECT_HOLD_TRANSFERS", "").replace("{agent}", name)
        self._held: list[Transfer] = []

    def _holding(self) -> bool:
        return self.hold or bool(self._hold_path and os.path.exists(self._hold_path))

    def _hold(self, t: Transfer) -> Transfer:
        """Keeps ``t`` (posted, not yet handed to NIXL) in flight until the hold ends."""
        t._held = True
        self._held.append(t)
        self._live.add(t)
        if self._hold_path:
            with open(self._hold_path + ".held", "a") as f:
                f.write(f"{t._what()}\n")
        return t

    def _post_held(self) -> None:
        """Once the hold ends, hands the held transfers to NIXL in posting order."""
        if not self._held or self._holding():
            return
        held, self._held = self._held, []
        for t in held:
            t._held = False
            try:
                state = self._agent.transfer(t._handle)
            except Exception as e:
                logger.warning("%s: held %s failed to post: %s", self.name, t._what(), e)
                state = "ERR"
            if state == "DONE" and not t._released:
                t._complete()
            elif state not in ("DONE", "PROC"):
                t._free()
            elif t._released:
                t._settle()
