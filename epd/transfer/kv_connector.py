"""The KV connector: moving a request's prompt KV from a prefill instance into a decode instance.

Two halves behind one interface each, so a second transport (a TCP fallback,
Mooncake's transfer engine) implements ``KVSender`` / ``KVReceiver`` and the
workers, the engine and the router stay as they are. The seams follow vLLM v1's
``KVConnectorBase_V1`` (see docs/architecture.md, "KV connector"):

- **sender** (prefill side). Scheduler side: ``request_finished(seq)`` keeps a
  finished prompt's blocks until its KV is sent. Worker side: ``build_step``
  plans a step's writes and gives the per-layer hook (one NIXL write per layer as
  soon as that layer's K/V is stored, overlapping the remaining layers) plus the
  staging packs (heterogeneous TP); ``poll`` reports sends that finished (the
  decode instance was notified with ``KVReady``) or failed.
- **receiver** (decode side). ``add`` reserves blocks for a prompt (the engine's
  sequence waits in ``WAITING_FOR_REMOTE_KV``), ``poll`` turns ``KVReady``
  notifications into running requests (unpacking staged KV first), ``abort``
  fences a reservation whose KV may still be in flight.

Block to block when both sides run TP 1: per layer, K and V of every block,
descriptors built with ``block_regions`` against the peer's advertised
``KVLayout`` (block ids are checked against its block count). Otherwise staged:
each prefill rank packs its KV heads of the request into a contiguous staging
range (``epd.transfer.staging``), one write per layer moves it, each decode rank
unpacks its heads.
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from epd.engine.model_runner import StepKV
from epd.engine.scheduler import SchedulerOutput
from epd.errors import InvalidRequestError
from epd.messages import (KVLayout, KVReady, KVReserved, Message, MessageError, PeerInfo, PrefillRequest,
                          RequestFailed, ReserveKV, decode, encode)
from epd.outputs import RequestOutput
from epd.sequence import Sequence
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError, block_regions
from epd.transfer.staging import StagingPool

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

__all__ = ["KVReceiver", "KVSend", "KVSender", "NixlKVReceiver", "NixlKVSender", "kv_layout"]


def kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, tp: int,
              staging: StagingPool | None) -> KVLayout:
    """The ``KVLayout`` a worker advertises to its peers.

    ``k_cache`` / ``v_cache``: [num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim]
    (this rank's paged cache); ``staging``: the instance's staging pool, or None.
    """
    layers = k_cache.shape[0]
    return KVLayout(
        num_layers=layers, num_blocks=k_cache.shape[1], block_size=block_size,
        num_kv_heads=k_cache.shape[3], head_dim=k_cache.shape[4], dtype=_DTYPE_NAMES[k_cache.dtype],
        k_regions=[(k_cache[i].data_ptr(), k_cache[i].nbytes, 0) for i in range(layers)],
        v_regions=[(v_cache[i].data_ptr(), v_cache[i].nbytes, 0) for i in range(layers)],
        tp=tp, staging_regions=staging.layer_regions() if staging is not None else [],
        staging_block_bytes=staging.region(0, 0, 1)[1] if staging is not None else 0)


# ---- the interfaces ------------------------------------------------------------------
class KVSender(abc.ABC):
    """Prefill side: sends each finished prompt's KV to the decode instance the router chose."""

    @abc.abstractmethod
    def add(self, req: PrefillRequest, arrival: float) -> bool:
        """Take a request whose KV goes to ``req.decode_instance``. False: no staging
        room right now (nothing changed; try again when ``has_room``).

        Raises:
            InvalidRequestError: unknown decode instance, or a TP pair the two sides
                cannot stage.
            StagingPoolError: the prompt can never fit the staging pool.
        """

    @abc.abstractmethod
    def has_room(self, req: PrefillRequest) -> bool:
        """Whether ``add`` would find staging room for ``req`` now."""

    @abc.abstractmethod
    def build_step(self, sched: SchedulerOutput) -> StepKV | None:
        """Worker side: the writes of this step's finishing prompts, as a per-layer hook
        (and staging packs). None: nothing to send this step."""

    @abc.abstractmethod
    def request_finished(self, seq: Sequence) -> bool:
        """Scheduler side: True when ``seq``'s blocks must stay until its KV is sent."""

    @abc.abstractmethod
    def poll(self) -> tuple[list[KVSend], list[tuple[KVSend, str]]]:
        """Sends that completed (the decode side was notified) and sends that failed
        (with the reason); their blocks and staging are free again."""

    @abc.abstractmethod
    def prefill_start(self, request_id: str) -> float:
        """Monotonic time the request's first chunk was scheduled (0: not yet)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Forget a request wherever it is; frees what the sender holds. Unknown ids are ignored."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """``num_held`` / ``num_sending``: finished prompts whose KV is still on its way."""


class KVReceiver(abc.ABC):
    """Decode side: reserves blocks, admits requests whose KV arrived, fences aborted ones."""

    @abc.abstractmethod
    def add(self, msg: ReserveKV) -> list[Message]:
        """Queue a reservation; returns the answers (``KVReserved`` / ``RequestFailed``)
        of the reservations that can be answered now, in arrival order."""

    @abc.abstractmethod
    def poll(self) -> tuple[list[Message], list[RequestOutput]]:
        """Answers to send to the router (``KVReserved`` / ``RequestFailed``), and the
        outputs of requests whose KV arrived and whose first token already ended them."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a reservation; one whose KV may still be in flight is fenced first."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """``num_quarantined``: aborted reservations not yet free."""


# ---- NIXL: prefill side ----------------------------------------------------------------
@dataclass(slots=True)
class KVSend:
    """One request's prompt KV on its way to ``decode_instance``.

    ``dst_block_ids``: the decode instance's reserved blocks; ``dst_staging_block``:
    first block of its staging range (-1: block to block); ``staging_block``: ours.
    ``seq``: the finished prompt, whose blocks are held until the send ends.
    """

    request_id: str
    decode_instance: str
    dst_block_ids: list[int]
    dst_staging_block: int
    arrival: float
    staging_block: int = -1
    prefill_start: float = 0.0
    seq: Sequence | None = None
    transfers: list[Transfer | None] = field(default_factory=list)
    send_start: float = 0.0
    kv_bytes: int = 0
    write_s: float = 0.0  # time inside write() calls (on CPU, cma copies synchronously there)

    @property
    def first_token(self) -> int:
        return self.seq.token_ids[-1]


class NixlKVSender(KVSender):
    """``KVSender`` over a ``NixlTransport``.

    Args:
        transport: this worker's NIXL agent (KV cache and staging registered).
        layout: this worker's ``KVLayout``; ``peers``: the router's ``PeerInfo`` by
            instance id (read at use, so peers that join later are seen).
        staging: this instance's staging pool, or None; ``tp``: this instance's TP.
        free_blocks: frees a held sequence's blocks (the engine's block manager).
        fenced: ``fenced(t)`` is True when the process was frozen after monotonic
            ``t`` (its requests may have been retried elsewhere: write nothing).
        timeout_s: a send not complete this long after its first write fails.
    """

    def __init__(self, transport: NixlTransport, layout: KVLayout, peers: dict[str, PeerInfo],
                 staging: StagingPool | None, tp: int, instance_id: str, *,
                 free_blocks: Callable[[Sequence], None], fenced: Callable[[float], bool], timeout_s: float) -> None:
        self.transport, self.layout, self.peers, self.staging = transport, layout, peers, staging
        self.tp, self.instance_id, self.timeout_s = tp, instance_id, timeout_s
        self._free_blocks, self._fenced = free_blocks, fenced
        self.sends: dict[str, KVSend] = {}
        # Fault injection for recovery tests: the first N requests' KV writes fail
        # as a dead link would (TransferError), exercising --kv-failure-policy.
        self.inject_failures = int(os.environ.get("EPD_INJECT_KV_FAILURES", "0") or 0)

    def add(self, req: PrefillRequest, arrival: float) -> bool:
        if req.decode_instance not in self.peers:
            raise InvalidRequestError(f"unknown decode instance {req.decode_instance!r}")
        send = KVSend(req.request_id, req.decode_instance, list(req.decode_block_ids), req.decode_staging_block,
                      arrival)
        d = self.peers[req.decode_instance].kv_layout
        if req.decode_staging_block < 0:
            if self.tp != 1 or d.tp != 1:
                raise InvalidRequestError(
                    f"prefill TP {self.tp} -> decode TP {d.tp} needs staged KV, but decode instance "
                    f"{req.decode_instance} reserved no staging range (start it with --kv-staging-mb > 0)")
        else:
            if self.staging is None:
                raise InvalidRequestError(
                    f"decode instance {req.decode_instance} expects staged KV, but prefill instance "
                    f"{self.instance_id} has no staging pool (start it with --kv-staging-mb > 0)")
            if d.staging_block_bytes != self.staging.region(0, 0, 1)[1]:
                raise InvalidRequestError(f"decode instance {req.decode_instance} stages a different KV layout")
            start = self.staging.alloc(req.request_id, len(req.decode_block_ids))
            if start is None:
                return False
            send.staging_block = start
        self.sends[req.request_id] = send
        return True

    def has_room(self, req: PrefillRequest) -> bool:
        return self.staging is not None and self.staging.can_alloc(len(req.decode_block_ids))

    def prefill_start(self, request_id: str) -> float:
        send = self.sends.get(request_id)
        return send.prefill_start if send is not None else 0.0

    def request_finished(self, seq: Sequence) -> bool:
        send = self.sends.get(seq.request_id)
        if send is None:
            return False
        send.seq = seq
        return True

    def build_step(self, sched: SchedulerOutput) -> StepKV | None:
        now = time.monotonic()
        for s in sched.scheduled:  # a prefill starts with its first scheduled chunk
            send = self.sends.get(s.seq.request_id)
            if send is not None and not send.prefill_start:
                send.prefill_start = now
        plans = [(self.sends[s.seq.request_id], s.seq.block_table[:len(self.sends[s.seq.request_id].dst_block_ids)])
                 for s in sched.scheduled if s.sample and s.seq.request_id in self.sends]
        if not plans:
            return None
        packs = [(send.staging_block, src) for send, src in plans if send.staging_block >= 0]

        def hook(layer: int) -> None:
            for send, src in plans:
                self._write_layer(send, src, layer)

        return StepKV(hook, packs)

    def _regions(self, send: KVSend, src: list[int], layer: int) -> tuple[np.ndarray | list, np.ndarray | list]:
        """(local, remote) descriptors of one layer of one send: one contiguous staging
        range when staged (one request per layer, any block count), else every block's K and V.

        Raises:
            ValueError: a destination block id outside the peer's cache.
        """
        d = self.peers[send.decode_instance].kv_layout
        if send.staging_block >= 0:
            local = self.staging.region(layer, send.staging_block, len(src))
            remote = (d.staging_regions[layer][0] + send.dst_staging_block * d.staging_block_bytes, local[1], 0)
            return [local], [remote]
        bb, me = self.layout.block_bytes, self.layout
        local = np.concatenate([block_regions(me.k_regions[layer], bb, src),
                                block_regions(me.v_regions[layer], bb, src)])
        remote = np.concatenate([block_regions(d.k_regions[layer], bb, send.dst_block_ids),
                                 block_regions(d.v_regions[layer], bb, send.dst_block_ids)])
        return local, remote

    def _write_layer(self, send: KVSend, src: list[int], layer: int) -> None:
        t0 = time.monotonic()
        if not send.send_start:
            send.send_start = t0
        if self._fenced(send.arrival):  # the router may already have retried it elsewhere
            send.transfers.append(None)
            return
        try:
            local, remote = self._regions(send, src, layer)
            if self.inject_failures > 0 and layer == 0:
                self.inject_failures -= 1
                raise TransferError("injected KV write failure (EPD_INJECT_KV_FAILURES)")
            send.transfers.append(self.transport.write(send.decode_instance, local, remote))
            send.kv_bytes += int(sum(r[1] for r in local))
        except (TransferError, ValueError) as e:
            logger.warning("prefill %s: KV write for %s failed: %s", self.instance_id, send.request_id, e)
            send.transfers.append(None)
        send.write_s += time.monotonic() - t0

    def poll(self) -> tuple[list[KVSend], list[tuple[KVSend, str]]]:
        now = time.monotonic()
        done: list[KVSend] = []
        failed: list[tuple[KVSend, str]] = []
        for rid, send in list(self.sends.items()):
            if send.seq is None:
                continue
            try:
                if any(t is None for t in send.transfers):
                    raise TransferError(f"KV write to {send.decode_instance} could not be issued")
                if not all(t.poll() for t in send.transfers):
                    if now - send.send_start > self.timeout_s:
                        raise TransferError(f"KV write to {send.decode_instance} passed its "
                                            f"{self.timeout_s} s deadline")
                    continue
                self.transport.send_notif(send.decode_instance, encode(KVReady(rid, send.first_token, src_tp=self.tp)))
            except TransferError as e:
                failed.append((send, str(e)))
            else:
                done.append(send)
            self.abort(rid)
        return done, failed

    def abort(self, request_id: str) -> None:
        send = self.sends.pop(request_id, None)
        if send is not None:
            for t in send.transfers:
                if t is not None:
                    t.release()
            if send.seq is not None:
                self._free_blocks(send.seq)
        if self.staging is not None:
            self.staging.free(request_id)

    def stats(self) -> dict[str, float]:
        held = sum(1 for s in self.sends.values() if s.seq is not None)
        return {"num_held": held, "num_sending": held}


# ---- NIXL: decode side -------------------------------------------------------------------
class NixlKVReceiver(KVReceiver):
    """``KVReceiver`` over a ``NixlTransport``: reservations in arrival order, ``KVReady``
    notifications from prefill workers (sent only after every layer's write completed,
    so decode never runs on partial KV).

    An aborted reservation whose KV never arrived is quarantined for ``quarantine_s``
    before its blocks are free again: a prefill worker that was slow (or frozen) may
    still be mid-write into them, and those bytes must not land in another request's blocks.
    """

    def __init__(self, engine, transport: NixlTransport, staging: StagingPool | None, instance_id: str, *,
                 quarantine_s: float = 1.0) -> None:
        self.engine, self.transport, self.staging = engine, transport, staging
        self.instance_id, self.quarantine_s = instance_id, quarantine_s
        self.pending: deque[ReserveKV] = deque()
        self.quarantine: deque[tuple[float, str]] = deque()  # (free at, request id), in time order
        self.reserved: dict[str, list[int]] = {}  # request id -> its blocks, KV not arrived yet

    def add(self, msg: ReserveKV) -> list[Message]:
        self.pending.append(msg)
        replies: list[Message] = []
        self._reserve_pending(replies)
        return replies

    def _reserve_pending(self, out: list[Message]) -> None:
        block_size = self.engine.config.block_size
        while self.pending:
            msg = self.pending[0]
            # Staged KV (heterogeneous TP) also needs a contiguous staging range.
            n_staging = -(-len(msg.prompt_token_ids) // block_size) if self.staging else 0
            try:
                if self.staging is not None and n_staging > self.staging.num_blocks:
                    raise ValueError(f"the prompt's KV needs {n_staging} staging blocks but this decode "
                                     f"instance's staging pool has {self.staging.num_blocks}; raise --kv-staging-mb")
                if self.staging is not None and not self.staging.can_alloc(n_staging):
                    return  # no staging room yet: retry once a staged request arrives or aborts
                blocks = self.engine.add_remote_request(msg.request_id, list(msg.prompt_token_ids), msg.params)
            except (InvalidRequestError, ValueError) as e:
                self.pending.popleft()
                out.append(RequestFailed(msg.request_id, self.instance_id, str(e)))
                continue
            if blocks is None:
                return  # no room yet: keep order, retry after the next step frees blocks
            self.pending.popleft()
            self.reserved[msg.request_id] = blocks
            staging_block = self.staging.alloc(msg.request_id, n_staging) if self.staging is not None else -1
            out.append(KVReserved(msg.request_id, self.instance_id, blocks, staging_block))

    def _admit(self, msg: KVReady) -> RequestOutput:
        """Unpack a staged request's KV into its blocks on every TP rank (before it joins
        the batch), free its staging range, and run it."""
        blocks = self.reserved.pop(msg.request_id)
        owned = self.staging.owned(msg.request_id) if self.staging is not None else None
        if owned is not None:
            start, n = owned
            self.engine.runner.unpack_kv(start, blocks[:n], msg.src_tp)
            self.staging.free(msg.request_id)
        return self.engine.add_prefilled(msg.request_id, msg.first_token)

    def _release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
        self.engine.abort_request(request_id)
        if self.staging is not None:
            self.staging.free(request_id)

    def poll(self) -> tuple[list[Message], list[RequestOutput]]:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self._release(self.quarantine.popleft()[1])
        replies: list[Message] = []
        if self.pending:
            self._reserve_pending(replies)
        finished: list[RequestOutput] = []
        for peer, notifs in self.transport.get_notifs().items():
            for raw in notifs:
                try:
                    msg = decode(raw)
                except MessageError as e:
                    logger.warning("decode %s: bad notification from %s: %s", self.instance_id, peer, e)
                    continue
                if (isinstance(msg, KVReady) and msg.request_id in self.reserved
                        and not any(rid == msg.request_id for _, rid in self.quarantine)):
                    out = self._admit(msg)
                    if out.finished:  # the first token already ended it (EOS, max_tokens=1, ...)
                        finished.append(out)
        return replies, finished

    def abort(self, request_id: str) -> None:
        self.pending = deque(m for m in self.pending if m.request_id != request_id)
        if request_id in self.reserved:  # KV may still be in flight into these blocks
            if all(rid != request_id for _, rid in self.quarantine):
                self.quarantine.append((time.monotonic() + self.quarantine_s, request_id))
            return
        self._release(request_id)

    def stats(self) -> dict[str, float]:
        return {"num_quarantined": len(self.quarantine)}
