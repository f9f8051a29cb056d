"""The KV connector's prefill side over NIXL (``NixlKVSender``): each finished prompt's KV
goes to the decode instance the router chose, one write per layer (see
``epd.transfer.kv_connector`` for the interface and the two layouts)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from epd.engine.kv_connector_base import SchedulerOutput, StepKV
from epd.errors import InternalError
from epd.messages import KVLayout, KVReady, KVWriterDone, KVWriterFenced, PeerInfo, PrefillRequest, encode
from epd.sequence import Sequence
from epd.transfer.kv_connector import KVSend, KVSender
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError
from epd.transfer.regions import block_regions
from epd.transfer.staging import StagingPool

logger = logging.getLogger(__name__)

__all__ = ["NixlKVSender"]


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
            ``NixlKVRunner`` (``epd.transfer.kv_runner``): staged sends are then planned for every rank
            (``epd.transfer.rank_agent``), each rank writing its own heads, and polled
            on every rank before ``KVReady``.

    ``between_layers``: when set, called after each layer of every step (at most every
    ``BETWEEN_LAYERS_S``): the worker serves NIXL notifications that must not wait for
    a long prefill step (remote prefix pins, ``epd.transfer.remote_prefix``).
    """

    #: least seconds between two ``between_layers`` calls within a step
    BETWEEN_LAYERS_S = 0.002

    def __init__(self, transport: NixlTransport, layout: KVLayout, peers: dict[str, PeerInfo],
                 staging: StagingPool | None, tp: int, instance_id: str, *,
                 free_blocks: Callable[[Sequence], None], fenced: Callable[[float], bool], timeout_s: float,
                 runner=None) -> None:
        self.transport, self.layout, self.peers, self.staging = transport, layout, peers, staging
        self.tp, self.instance_id, self.timeout_s = tp, instance_id, timeout_s
        self.runner = runner if layout.kv_agents == "per-rank" else None
        self._free_blocks, self._fenced = free_blocks, fenced
        self.sends: dict[str, KVSend] = {}
        self.between_layers: Callable[[], None] | None = None
        self._between_at = 0.0
        # dropped sends whose released writes NIXL has not terminated yet: request id ->
        # (decode instance, generation, their transfers, monotonic time of the drop). Their
        # KVWriterDone waits for the last to terminate; one that never does keeps the
        # reservation fenced until this process is gone.
        self.unterminated: dict[str, tuple[str, int, list[Transfer], float]] = {}
        self.num_unterminated = 0  # drops whose writes were not terminated within timeout_s
        self._late: set[str] = set()  # of ``unterminated``, those counted in num_unterminated
        self._fence_pending: set[str] = set()  # decode peers owed a KVWriterFenced (fence_all)
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
        num_blocks = -(-len(req.prompt_token_ids) // self.layout.block_size)
        if req.decode_num_cached_blocks + len(req.decode_block_ids) > num_blocks:
            raise InternalError(f"decode instance {req.decode_instance} reserved {req.decode_num_cached_blocks} "
                                f"cached + {len(req.decode_block_ids)} blocks for a prompt of {num_blocks}")
        send = KVSend(req.request_id, req.decode_instance, list(req.decode_block_ids), req.decode_staging_block,
                      req.decode_generation, arrival, dst_first_block=req.decode_num_cached_blocks)
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
        plans = [(send, s.seq.block_table[send.dst_first_block:send.dst_first_block + len(send.dst_block_ids)])
                 for s in sched.scheduled if s.sample and (send := self.sends.get(s.seq.request_id)) is not None]
        if not plans:
            return StepKV(self._between) if self.between_layers is not None else None
        packs = [(send.staging_block, src) for send, src in plans if send.staging_block >= 0]
        if self.runner is not None and packs:
            packs = self._plan_ranks([(send, src) for send, src in plans if send.staging_block >= 0], now)
            plans = [(send, src) for send, src in plans if send.staging_block < 0]

        def hook(layer: int) -> None:
            for send, src in plans:
                self._write_layer(send, src, layer)
            self._between(layer)

        return StepKV(hook if plans or self.between_layers is not None else None, packs)

    def _between(self, layer: int) -> None:
        now = time.monotonic()
        if self.between_layers is not None and now - self._between_at >= self.BETWEEN_LAYERS_S:
            self._between_at = now
            self.between_layers()

    def _plan_ranks(self, staged: list[tuple[KVSend, list[int]]], now: float) -> list[tuple[int, list[int]]]:
        """Per-rank agents: give every rank this step's writes of ``staged``; returns
        the staging packs of the sends that will be written (a fenced or injected-failure
        send is failed at once: nothing of it is written)."""
        from epd.messages import KVPlan
        from epd.transfer.rank_agent import plan_send

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
        if self.unterminated:
            self._settle(now)
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
        """Forget a send: release its transfers (asking NIXL to cancel those in flight;
        the ones it cannot cancel are kept in ``unterminated``), its held blocks and its
        staging range."""
        send = self.sends.pop(request_id, None)
        if send is not None:
            live = [t for t in send.transfers if t is not None and not t.release()]
            if live:
                self.unterminated[request_id] = (send.decode_instance, send.dst_generation, live, time.monotonic())
            if send.rank_state > 0:  # every rank's writes still held: cancel them there
                self.runner.release_kv([request_id])
            if send.seq is not None:
                self._free_blocks(send.seq)
        if self.staging is not None:
            self.staging.free(request_id)
        return send

    def abort(self, request_id: str) -> bool:
        """Drop a send; tell its decode instance ``KVWriterDone`` once every write of it
        terminated (now, or in a later ``poll``). False: no such send."""
        send = self._drop(request_id)
        if send is None:
            return False
        if request_id not in self.unterminated:
            self._notify_never(send.decode_instance, request_id, send.dst_generation)
        return True

    def _settle(self, now: float) -> None:
        """Poll the released writes of dropped sends: a send whose writes all terminated
        sends its ``KVWriterDone``; one still in flight ``timeout_s`` after its drop is
        counted once (``num_unterminated``) and stays fenced, polled on."""
        for rid, (decode_instance, generation, transfers, dropped) in list(self.unterminated.items()):
            if all(t.terminated for t in transfers):
                del self.unterminated[rid]
                self._late.discard(rid)
                self._notify_never(decode_instance, rid, generation)
            elif now - dropped > self.timeout_s and rid not in self._late:
                self._late.add(rid)
                self.num_unterminated += 1
                logger.error("prefill %s: the KV writes of %s to %s did not terminate %.0f s after their "
                             "release: its blocks there stay fenced until this process exits", self.instance_id,
                             rid, decode_instance, self.timeout_s)
        if self._fence_pending:
            self._send_fences()

    def decline(self, req: PrefillRequest) -> None:
        self._notify_never(req.decode_instance, req.request_id, req.decode_generation)

    def fence_all(self) -> None:
        """After the router was lost and every send dropped: tell each decode peer
        that no earlier instruction of this worker will ever write (``KVWriterFenced``),
        once the released writes to it have terminated (``poll`` sends the rest)."""
        for name, peer in self.peers.items():
            if peer.kv_layout is not None:  # (an encoder holds no reservations)
                self._fence_pending.add(name)
        self._send_fences()

    def _send_fences(self) -> None:
        busy = {decode_instance for decode_instance, _, _, _ in self.unterminated.values()}
        for name in sorted(self._fence_pending - busy):
            self._fence_pending.discard(name)
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
        return {"num_held": held, "num_sending": held, "num_unterminated_sends": len(self.unterminated),
                "transfers_unterminated": self.num_unterminated}
