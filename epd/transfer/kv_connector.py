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
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from epd.engine.model_runner import StepKV
from epd.engine.scheduler import SchedulerOutput
from epd.errors import InternalError
from epd.messages import (KVLayout, KVReady, KVReserved, KVWriterDone, KVWriterFenced, Message, MessageError,
                          PeerInfo, PrefillRequest, RankKV, RequestFailed, ReserveKV, decode, encode)
from epd.outputs import RequestOutput
from epd.sequence import Sequence
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError, block_regions, layer_regions
from epd.transfer.staging import StagingPool

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

__all__ = ["KVReceiver", "KVSend", "KVSender", "NixlKVReceiver", "NixlKVSender", "kv_layout"]


def kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, tp: int,
              staging: StagingPool | None, kv_quant: str | None = None, kv_agents: str = "rank0",
              ranks: list[RankKV] | None = None) -> KVLayout:
    """The ``KVLayout`` a worker advertises to its peers.

    ``k_cache`` / ``v_cache``: [num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim]
    (this rank's paged cache); ``staging``: the instance's staging pool, or None (with
    per-rank agents rank 0's private pool of its own heads);
    ``kv_quant``: a quantized cache's kind ("int8", "fp8_e4m3": uint8 rows of head_dim + scale_bytes(head_dim)
    bytes, advertised with that name as ``dtype`` and the row length as ``head_dim``);
    ``kv_agents`` / ``ranks``: see ``KVLayout`` (``ranks``: every rank's ``RankKV``).
    """
    layers = k_cache.shape[0]
    block_bytes = staging.region(0, 0, 1)[1] if staging is not None else 0
    if kv_agents == "per-rank":
        block_bytes *= tp  # advertised as one block of every head, as the shared pool's
    return KVLayout(
        num_layers=layers, num_blocks=k_cache.shape[1], block_size=block_size,
        num_kv_heads=k_cache.shape[3], head_dim=k_cache.shape[4],
        dtype=kv_quant if kv_quant is not None else _DTYPE_NAMES[k_cache.dtype],
        k_regions=layer_regions(k_cache), v_regions=layer_regions(v_cache),
        tp=tp, staging_regions=staging.layer_regions() if staging is not None else [],
        staging_block_bytes=block_bytes, kv_agents=kv_agents, ranks=list(ranks or []))


# ---- the interfaces ------------------------------------------------------------------
class KVSender(abc.ABC):
    """Prefill side: sends each finished prompt's KV to the decode instance the router chose."""

    @abc.abstractmethod
    def add(self, req: PrefillRequest, arrival: float) -> bool:
        """Take a request whose KV goes to ``req.decode_instance``. False: no staging
        room right now (nothing changed; try again when ``has_room``).

        Raises:
            InternalError: unknown decode instance, or a TP pair the two sides cannot stage.
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
    def abort(self, request_id: str) -> bool:
        """Forget a request wherever it is; frees what the sender holds and, once none of
        its writes can land any more, tells the decode side (``KVWriterDone``). Returns
        False for an id the sender does not hold (nothing done)."""

    @abc.abstractmethod
    def decline(self, req: PrefillRequest) -> None:
        """Tell ``req``'s decode instance that this sender will never write its blocks
        (a request dropped before ``add`` took it)."""

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
    def abort(self, request_id: str, kv_writer: str = "", kv_writer_pid: int = 0) -> None:
        """Drop a reservation; one that writer ``kv_writer`` (process ``kv_writer_pid``) may
        still be writing stays fenced until the writer is done or gone."""

    @abc.abstractmethod
    def writer_gone(self, instance_id: str, pid: int) -> None:
        """A writer's process exited: nothing it was told to write can land any more."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """``num_quarantined``: aborted reservations still fenced for their writer."""


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
    dst_generation: int
    arrival: float
    staging_block: int = -1
    prefill_start: float = 0.0
    seq: Sequence | None = None
    transfers: list[Transfer | None] = field(default_factory=list)
    send_start: float = 0.0
    kv_bytes: int = 0
    write_s: float = 0.0  # time inside write() calls (on CPU, cma copies synchronously there)
    rank_writes: int = 0  # per-rank agents: NIXL writes of every rank (0: none posted by the ranks)
    rank_state: int = -1  # per-rank agents: the last KVPoll state (-1: not posted yet)

    @property
    def num_writes(self) -> int:
        """NIXL write requests of this send (every rank's)."""
        return self.rank_writes or len(self.transfers)

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
        runner: with per-rank agents (``layout.kv_agents`` "per-rank"), rank 0's
            ``ModelRunner``: staged sends are then planned for every rank
            (``epd.transfer.rank_agent``), each rank writing its own heads, and polled
            on every rank before ``KVReady``.
    """

    def __init__(self, transport: NixlTransport, layout: KVLayout, peers: dict[str, PeerInfo],
                 staging: StagingPool | None, tp: int, instance_id: str, *,
                 free_blocks: Callable[[Sequence], None], fenced: Callable[[float], bool], timeout_s: float,
                 runner=None) -> None:
        self.transport, self.layout, self.peers, self.staging = transport, layout, peers, staging
        self.tp, self.instance_id, self.timeout_s = tp, instance_id, timeout_s
        self.runner = runner if layout.kv_agents == "per-rank" else None
        self._free_blocks, self._fenced = free_blocks, fenced
        self.sends: dict[str, KVSend] = {}
        # Fault injection for recovery tests: the first N requests' KV writes fail
        # as a dead link would (TransferError), exercising --kv-failure-policy.
        self.inject_failures = int(os.environ.get("EPD_INJECT_KV_FAILURES", "0") or 0)
        # ... and, for prompts of at least EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS blocks, each
        # layer after the first is written this many seconds late, as a long final prefill
        # chunk on a slow machine would be (the stale-write tests).
        self.inject_write_delay_s = float(os.environ.get("EPD_INJECT_KV_WRITE_DELAY_S", "0") or 0)
        self.inject_write_delay_min_blocks = int(os.environ.get("EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS", "0") or 0)

    def add(self, req: PrefillRequest, arrival: float) -> bool:
        if req.decode_instance not in self.peers:
            raise InternalError(f"unknown decode instance {req.decode_instance!r}")
        send = KVSend(req.request_id, req.decode_instance, list(req.decode_block_ids), req.decode_staging_block,
                      req.decode_generation, arrival)
        d = self.peers[req.decode_instance].kv_layout
        if d.dtype != self.layout.dtype:
            raise InternalError(f"decode instance {req.decode_instance} holds a {d.dtype} KV cache, this prefill "
                                f"instance a {self.layout.dtype} one: start both with the same --dtype "
                                f"and --kv-cache-dtype")
        if req.decode_staging_block < 0:
            if self.tp != 1 or d.tp != 1:
                raise InternalError(
                    f"prefill TP {self.tp} -> decode TP {d.tp} needs staged KV, but decode instance "
                    f"{req.decode_instance} reserved no staging range (start it with --kv-staging-mb > 0)")
        else:
            if self.staging is None:
                raise InternalError(
                    f"decode instance {req.decode_instance} expects staged KV, but prefill instance "
                    f"{self.instance_id} has no staging pool (start it with --kv-staging-mb > 0)")
            if d.staging_block_bytes != self.layout.staging_block_bytes:
                raise InternalError(f"decode instance {req.decode_instance} stages a different KV layout")
            if d.kv_agents != self.layout.kv_agents and (self.tp > 1 or d.tp > 1):
                raise InternalError(f"decode instance {req.decode_instance} runs --kv-agents {d.kv_agents}, this "
                                    f"prefill instance {self.layout.kv_agents}: start both with the same")
            if self.runner is not None and (max(self.tp, d.tp) % min(self.tp, d.tp) or len(d.ranks) != d.tp):
                raise InternalError(f"prefill TP {self.tp} -> decode TP {d.tp}: per-rank agents need one TP to "
                                    f"divide the other and every decode rank's agent advertised")
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
        plans = [(send, s.seq.block_table[:len(send.dst_block_ids)]) for s in sched.scheduled
                 if s.sample and (send := self.sends.get(s.seq.request_id)) is not None]
        if not plans:
            return None
        packs = [(send.staging_block, src) for send, src in plans if send.staging_block >= 0]
        if self.runner is not None and packs:
            packs = self._plan_ranks([(send, src) for send, src in plans if send.staging_block >= 0], now)
            plans = [(send, src) for send, src in plans if send.staging_block < 0]

        def hook(layer: int) -> None:
            for send, src in plans:
                self._write_layer(send, src, layer)

        return StepKV(hook if plans else None, packs)

    def _plan_ranks(self, staged: list[tuple[KVSend, list[int]]], now: float) -> list[tuple[int, list[int]]]:
        """Per-rank agents: give every rank this step's writes of ``staged``; returns
        the staging packs of the sends that will be written (a fenced or injected-failure
        send is failed at once: nothing of it is written)."""
        from epd.transfer.rank_agent import KVPlan, plan_send

        sends, packs = [], []
        layers, full = self.layout.num_layers, self.layout.staging_block_bytes
        for send, src in staged:
            send.send_start = send.send_start or now
            if self._fenced(send.arrival) or self.inject_failures > 0:
                if not self._fenced(send.arrival):
                    self.inject_failures -= 1
                    logger.warning("prefill %s: injected KV write failure for %s (EPD_INJECT_KV_FAILURES)",
                                   self.instance_id, send.request_id)
                send.transfers.append(None)
                continue
            d = self.peers[send.decode_instance].kv_layout
            try:
                rs = plan_send(send.request_id, send.staging_block, len(src), full, self.tp, d,
                               send.dst_staging_block)
            except ValueError as e:
                logger.warning("prefill %s: KV write for %s failed: %s", self.instance_id, send.request_id, e)
                send.transfers.append(None)
                continue
            sends.append(rs)
            packs.append((send.staging_block, src))
            send.rank_writes = layers * len(rs.targets)
            send.kv_bytes = layers * len(rs.targets) * rs.part_bytes
            send.rank_state = 1
        if sends:
            self.runner.set_kv_plan(KVPlan(sends))
        return packs

    def _regions(self, send: KVSend, src: list[int], layer: int) -> tuple[np.ndarray | list, np.ndarray | list]:
        """(local, remote) descriptors of one layer of one send: one contiguous staging
        range when staged (one request per layer, any block count), else every block's K and V.

        Raises:
            ValueError: a destination block id outside the peer's cache.
        """
        d = self.peers[send.decode_instance].kv_layout
        if send.staging_block >= 0:
            local = self.staging.region(layer, send.staging_block, len(src))
            dst = d.staging_regions[layer]
            remote = (dst[0] + send.dst_staging_block * d.staging_block_bytes, local[1], dst[2])
            return [local], [remote]
        bb, me = self.layout.block_bytes, self.layout
        local = np.concatenate([block_regions(me.k_regions[layer], bb, src),
                                block_regions(me.v_regions[layer], bb, src)])
        remote = np.concatenate([block_regions(d.k_regions[layer], bb, send.dst_block_ids),
                                 block_regions(d.v_regions[layer], bb, send.dst_block_ids)])
        return local, remote

    def _write_layer(self, send: KVSend, src: list[int], layer: int) -> None:
        if self.inject_write_delay_s and layer > 0 and len(src) >= self.inject_write_delay_min_blocks:
            time.sleep(self.inject_write_delay_s)
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
        ranked = [rid for rid, send in self.sends.items() if send.seq is not None and send.rank_state > 0
                  and not any(t is None for t in send.transfers)]
        if ranked:  # per-rank agents: one poll of every rank for all of them
            for rid, state in zip(ranked, self.runner.poll_kv(ranked)):
                self.sends[rid].rank_state = state
        for rid, send in list(self.sends.items()):
            if send.seq is None:
                continue
            try:
                if any(t is None for t in send.transfers):
                    raise TransferError(f"KV write to {send.decode_instance} could not be issued")
                if send.rank_state == 2:
                    raise TransferError(f"KV write to {send.decode_instance} failed on a TP rank")
                if send.rank_state == 1 or not all(t.poll() for t in send.transfers):
                    if now - send.send_start > self.timeout_s:
                        raise TransferError(f"KV write to {send.decode_instance} passed its "
                                            f"{self.timeout_s} s deadline")
                    continue
                self.transport.send_notif(send.decode_instance, encode(
                    KVReady(rid, send.first_token, src_tp=self.tp, generation=send.dst_generation)))
            except TransferError as e:
                failed.append((send, str(e)))
                self.abort(rid)
            else:
                done.append(send)
                self._drop(rid)
        return done, failed

    def _drop(self, request_id: str) -> KVSend | None:
        """Forget a send: release its transfers (cancelling any still in flight: none of
        its writes lands after this), its held blocks and its staging range."""
        send = self.sends.pop(request_id, None)
        if send is not None:
            for t in send.transfers:
                if t is not None:
                    t.release()
            if send.rank_state > 0:  # every rank's writes still held: cancel them there
                self.runner.release_kv([request_id])
            if send.seq is not None:
                self._free_blocks(send.seq)
        if self.staging is not None:
            self.staging.free(request_id)
        return send

    def abort(self, request_id: str) -> bool:
        send = self._drop(request_id)
        if send is None:
            return False
        self._notify_never(send.decode_instance, request_id, send.dst_generation)
        return True

    def decline(self, req: PrefillRequest) -> None:
        self._notify_never(req.decode_instance, req.request_id, req.decode_generation)

    def fence_all(self) -> None:
        """After the router was lost and every send dropped: tell each decode peer
        that no earlier instruction of this worker will ever write (``KVWriterFenced``)."""
        for name, peer in self.peers.items():
            if peer.kv_layout is None:  # an encoder: holds no reservations
                continue
            try:
                self.transport.send_notif(name, encode(KVWriterFenced()))
            except TransferError as e:
                logger.warning("prefill %s: could not fence %s: %s", self.instance_id, name, e)

    def _notify_never(self, decode_instance: str, request_id: str, generation: int) -> None:
        try:
            self.transport.send_notif(decode_instance, encode(KVWriterDone(request_id, generation)))
        except TransferError as e:  # the decode worker is gone: nothing to fence there
            logger.warning("prefill %s: could not tell %s that %s is dropped: %s", self.instance_id,
                           decode_instance, request_id, e)

    def stats(self) -> dict[str, float]:
        held = sum(1 for s in self.sends.values() if s.seq is not None)
        return {"num_held": held, "num_sending": held}


# ---- NIXL: decode side -------------------------------------------------------------------
@dataclass(slots=True)
class _Reservation:
    """Blocks reserved for a prompt whose KV a prefill worker will write.

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

    def __init__(self, engine, transport: NixlTransport, staging: StagingPool | None, instance_id: str) -> None:
        self.engine, self.transport, self.staging = engine, transport, staging
        self.instance_id = instance_id
        self.pending: deque[ReserveKV] = deque()
        self.reserved: dict[str, _Reservation] = {}  # request id -> reservation whose KV has not arrived
        self._gone: set[tuple[str, int]] = set()  # writer processes known to have exited
        self.admitted: dict[str, float] = {}  # request id -> monotonic time its KV was admitted (decode queue)

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
                blocks = self.engine.add_remote_request(msg.request_id, list(msg.prompt_token_ids), msg.params,
                                                        mm_placeholders=list(msg.placeholders))
            except ValueError as e:  # InvalidRequestError included: the request's own fault
                self.pending.popleft()
                out.append(RequestFailed(msg.request_id, self.instance_id, str(e), status=400))
                continue
            if blocks is None:
                return  # no room yet: keep order, retry after the next step frees blocks
            self.pending.popleft()
            res = _Reservation(blocks, secrets.randbits(63), msg.kv_writer)
            self.reserved[msg.request_id] = res
            staging_block = self.staging.alloc(msg.request_id, n_staging) if self.staging is not None else -1
            out.append(KVReserved(msg.request_id, self.instance_id, blocks, staging_block, res.generation))

    def _admit(self, msg: KVReady) -> RequestOutput:
        """Unpack a staged request's KV into its blocks on every TP rank (before it joins
        the batch), free its staging range, and run it."""
        res = self.reserved.pop(msg.request_id)
        self.admitted[msg.request_id] = time.monotonic()
        owned = self.staging.owned(msg.request_id) if self.staging is not None else None
        if owned is not None:
            start, n = owned
            self.engine.runner.unpack_kv(start, res.blocks[:n], msg.src_tp)
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
        for peer, notifs in self.transport.get_notifs().items():
            for raw in notifs:
                try:
                    msg = decode(raw)
                except MessageError as e:
                    logger.warning("decode %s: bad notification from %s: %s", self.instance_id, peer, e)
                    continue
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
        return {"num_quarantined": sum(1 for r in self.reserved.values() if r.aborted)}
