"""The KV connector's decode side over NIXL (``NixlKVReceiver``): reservations, ``KVReady``
admissions, and the fences of aborted reservations (see ``epd.transfer.kv_connector``)."""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass

from epd.errors import error_status
from epd.messages import (
    KVReady,
    KVReserved,
    KVWriterDone,
    KVWriterFenced,
    Message,
    RequestFailed,
    ReserveKV,
)
from epd.outputs import RequestOutput
from epd.transfer.kv_connector import KVReceiver
from epd.transfer.nixl_transport import NixlTransport
from epd.transfer.notifications import decoded_notifs
from epd.transfer.staging import StagingPool

logger = logging.getLogger(__name__)

__all__ = ["NixlKVReceiver"]


@dataclass(slots=True)
class _Reservation:
    """Blocks reserved for a prompt whose KV a prefill worker will write (those after
    the prefix this instance's cache already held).

    ``generation``: random id echoed by the writer's notifications; ``expected_writer``:
    the prefill instance the router picked to write it (``ReserveKV.kv_writer``; "":
    not named), the only sender whose notifications count; ``writer``: (instance, pid)
    of the prefill worker the router told to write, once an abort named it (pid -1:
    any process of it, after the router was lost); ``writer_done``: that writer said
    it will never write (``KVWriterDone`` / ``KVWriterFenced``).
    """

    blocks: list[int]
    generation: int
    expected_writer: str = ""
    aborted: bool = False
    writer: tuple[str, int] | None = None
    writer_done: bool = False


class NixlKVReceiver(KVReceiver):
    """``KVReceiver`` over a ``NixlTransport``: reservations in arrival order, ``KVReady``
    notifications from prefill workers (sent only after every layer's write completed,
    so decode never runs on partial KV).

    A reservation's blocks return to the pool only when no writer can write them any
    more: an aborted reservation whose prefill worker was told to write (the router's
    ``Abort`` names it) stays fenced until that worker's ``KVWriterDone`` (sent once
    its send was dropped and every write of it ended) or until its process is gone
    (``writer_gone``: the launcher saw it exit, or a restart replaced it). Every
    notification must carry the reservation's random ``generation``, so a stale or
    forged one never admits or frees a reservation.
    """

    def __init__(self, engine, transport: NixlTransport, staging: StagingPool | None, instance_id: str,
                 kv_runner=None) -> None:
        self.engine, self.transport, self.staging = engine, transport, staging
        self.kv_runner = kv_runner  # rank 0's NixlKVRunner (epd.transfer.kv_runner): unpacks staged KV
        self.instance_id = instance_id
        self.pending: deque[ReserveKV] = deque()
        self.reserved: dict[str, _Reservation] = {}  # request id -> reservation whose KV has not arrived
        self._gone: set[tuple[str, int]] = set()  # writer processes known to have exited
        self.admitted: dict[str, float] = {}  # request id -> monotonic time its KV was admitted (decode queue)
        self.num_reused_blocks = 0  # prompt blocks found in the prefix cache here: not written by a prefill worker

    def add(self, msg: ReserveKV) -> list[Message]:
        self.pending.append(msg)
        replies: list[Message] = []
        self._reserve_pending(replies)
        return replies

    def _reserve_pending(self, out: list[Message]) -> None:
        block_size = self.engine.config.block_size
        while self.pending:
            msg = self.pending[0]
            # Staged KV (heterogeneous TP) also needs a contiguous staging range: checked
            # for the whole prompt, taken for the blocks the prefix cache lacks.
            n_staging = -(-len(msg.prompt_token_ids) // block_size) if self.staging else 0
            try:
                if self.staging is not None and n_staging > self.staging.num_blocks:
                    raise ValueError(f"the prompt's KV needs {n_staging} staging blocks but this decode "
                                     f"instance's staging pool has {self.staging.num_blocks}; raise --kv-staging-mb")
                if self.staging is not None and not self.staging.can_alloc(n_staging):
                    return  # no staging room yet: retry once a staged request arrives or aborts
                reserved = self.engine.add_remote_request(msg.request_id, list(msg.prompt_token_ids), msg.params,
                                                          mm_placeholders=list(msg.placeholders))
            except ValueError as e:  # InvalidRequestError (400): the request's own fault; else (500) this instance's
                self.pending.popleft()
                out.append(RequestFailed(msg.request_id, self.instance_id, str(e), status=error_status(e)))
                continue
            if reserved is None:
                return  # no room yet: keep order, retry after the next step frees blocks
            self.pending.popleft()
            blocks, num_cached = reserved
            res = _Reservation(blocks[num_cached:], secrets.randbits(63), msg.kv_writer)  # the blocks to write
            self.reserved[msg.request_id] = res
            self.num_reused_blocks += num_cached
            staging_block = self.staging.alloc(msg.request_id, len(res.blocks)) if self.staging is not None else -1
            out.append(KVReserved(msg.request_id, self.instance_id, res.blocks, staging_block, res.generation,
                                  num_cached_blocks=num_cached))

    def _admit(self, msg: KVReady) -> RequestOutput:
        """Unpack a staged request's KV into its blocks on every TP rank (before it joins
        the batch), free its staging range, and run it."""
        res = self.reserved.pop(msg.request_id)
        self.admitted[msg.request_id] = time.monotonic()
        owned = self.staging.owned(msg.request_id) if self.staging is not None else None
        if owned is not None:
            start, n = owned
            self.kv_runner.unpack_kv(start, res.blocks[:n], msg.src_tp)
            self.staging.free(msg.request_id)
        return self.engine.add_prefilled(msg.request_id, msg.first_token)

    def _release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
        self.admitted.pop(request_id, None)
        self.engine.abort_request(request_id)
        if self.staging is not None:
            self.staging.free(request_id)

    def _fenced_by(self, writer: str) -> None:
        """``writer`` will never write what it was told before now (``KVWriterFenced``)."""
        for rid, res in list(self.reserved.items()):
            if res.expected_writer == writer:
                res.writer_done = True
                if res.aborted:
                    self._release(rid)

    def _notification(self, msg: KVReady | KVWriterDone, sender: str) -> RequestOutput | None:
        res = self.reserved.get(msg.request_id)
        if res is None or res.generation != msg.generation or res.expected_writer not in ("", sender):
            logger.warning("decode %s: ignored %s for %s from %s (no such reservation, or another writer's)",
                           self.instance_id, type(msg).__name__, msg.request_id, sender)
            return None  # stale (an earlier reservation, already released), another writer's, or forged
        if isinstance(msg, KVWriterDone):
            res.writer_done = True
            if res.aborted:
                self._release(msg.request_id)
            return None
        if res.aborted:  # complete KV for a request the router gave up: its blocks are safe to free now
            self._release(msg.request_id)
            return None
        out = self._admit(msg)
        return out if out.finished else None  # the first token already ended it (EOS, max_tokens=1, ...)

    def poll(self) -> tuple[list[Message], list[RequestOutput]]:
        replies: list[Message] = []
        if self.pending:
            self._reserve_pending(replies)
        finished: list[RequestOutput] = []
        for peer, msg in decoded_notifs(self.transport):
            if isinstance(msg, KVWriterFenced):
                self._fenced_by(peer)
            elif isinstance(msg, (KVReady, KVWriterDone)) and (out := self._notification(msg, peer)) is not None:
                finished.append(out)
        return replies, finished

    def abort(self, request_id: str, kv_writer: str = "", kv_writer_pid: int = 0) -> None:
        """Drop ``request_id``. A reservation whose writer (``kv_writer``, process
        ``kv_writer_pid``; "" = none was told) may still write stays fenced (see the class)."""
        self.pending = deque(m for m in self.pending if m.request_id != request_id)
        res = self.reserved.get(request_id)
        if res is not None and kv_writer and not res.writer_done and (kv_writer, kv_writer_pid) not in self._gone:
            res.aborted = True
            res.writer = (kv_writer, kv_writer_pid)
            return
        self._release(request_id)

    def writer_gone(self, instance_id: str, pid: int) -> None:
        """The process ``pid`` of prefill instance ``instance_id`` exited: it writes nothing
        any more, so the reservations fenced for it are free."""
        self._gone.add((instance_id, pid))
        for rid, res in list(self.reserved.items()):
            if res.aborted and res.writer is not None and res.writer[0] == instance_id and res.writer[1] in (pid, -1):
                self._release(rid)

    def expected_writer(self, request_id: str) -> tuple[str, int]:
        """(instance, -1) of the writer a reservation expects ("" when none is pending):
        the fence ``abort`` keeps when the router that named the writer is gone."""
        res = self.reserved.get(request_id)
        return (res.expected_writer, -1) if res is not None and not res.aborted else ("", 0)

    def in_flight(self) -> set[str]:
        """Requests waiting for blocks or for their KV (fenced aborted ones excluded)."""
        return {m.request_id for m in self.pending} | {r for r, res in self.reserved.items() if not res.aborted}

    def fenced(self) -> set[str]:
        """Aborted reservations kept until their writer is done or gone."""
        return {r for r, res in self.reserved.items() if res.aborted}

    def stats(self) -> dict[str, float]:
        fenced = [r for r in self.reserved.values() if r.aborted]
        return {"num_quarantined": len(fenced), "num_fenced_blocks": sum(len(r.blocks) for r in fenced),
                "kv_reused_blocks": self.num_reused_blocks}
