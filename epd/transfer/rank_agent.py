"""Per-rank NIXL agents (``--kv-agents per-rank``): every TP rank writes its own KV heads.

As vLLM's ``NixlConnector`` has it, every TP rank of a prefill or decode instance owns
a NIXL agent that registers that rank's paged KV cache and its private staging buffer
(this rank's KV heads only; ``epd.transfer.staging``). Rank 0's agent is the worker's
own (named after the instance); rank r's is ``<instance>.tp<r>``, created in the TP
rank's process (``epd.transfer.kv_runner.NixlKVRunnerFactory``).

Staged layout of one request and one layer with ``g = max(src_tp, dst_tp)`` *parts*
of ``num_kv_heads / g`` heads each, part ``j`` = ``[2 (K, V), n, block_size,
num_kv_heads / g, head_dim]`` (``epd.kernels.kv_staging``):

* prefill rank r holds parts ``[r * g/src_tp, (r + 1) * g/src_tp)`` in its staging
  range (packed from its cache, ``NixlKVRunner._pack``, ``epd.transfer.kv_runner``);
* decode rank q holds parts ``[q * g/dst_tp, (q + 1) * g/dst_tp)`` in its staging range
  (scattered into its cache by ``NixlKVRunner._unpack``);
* one of ``g/src_tp``, ``g/dst_tp`` is 1, so every part moves with one NIXL WRITE from
  the prefill rank holding it to the decode rank that needs it: ``g`` writes per layer,
  ``num_layers * g`` per request (2->1, 1->2, 2->2, 2->4, 4->2 alike).

Control stays on the instance's own channel: rank 0 computes every rank's writes
(``RankSend``: addresses on the decode side's ranks, from their advertised
``epd.messages.RankKV``) and broadcasts them with the step (``KVPlan``, msgpack over the
gloo group, never pickle; the messages are in ``epd.messages.tp``); each rank posts its writes
right after packing each layer;
rank 0 asks every rank for the state of its writes (``KVPoll``: one gather) and sends
``KVReady`` once all of them are done; ``KVRelease`` cancels a request's writes on
every rank (abort, failure, deadline).
"""

from __future__ import annotations

import logging

from epd.messages import KVPlan, RankPeers, RankSend, RankTarget
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError

logger = logging.getLogger(__name__)

__all__ = ["RankKVWriter", "WRITE_DONE", "WRITE_FAILED", "WRITE_PENDING", "rank_agent_name", "plan_send"]

#: states of one request's writes on one rank (``KVPoll``); the instance's state is the highest
WRITE_DONE, WRITE_PENDING, WRITE_FAILED = 0, 1, 2


def rank_agent_name(instance_id: str, rank: int) -> str:
    """The NIXL agent name of ``rank`` of ``instance_id`` (rank 0: the instance's own agent)."""
    return instance_id if rank == 0 else f"{instance_id}.tp{rank}"


def plan_send(request_id: str, staging_block: int, num_blocks: int, full_block_bytes: int, src_tp: int,
              dst_layout, dst_staging_block: int) -> RankSend:
    """Every rank's writes of one staged request to the decode instance of ``dst_layout``.

    Args:
        staging_block, num_blocks: the request's range in this (prefill) instance's pools.
        full_block_bytes: one staging block of one layer with *all* KV heads (K and V), bytes.
        src_tp: this instance's TP; ``dst_layout``: the decode instance's ``KVLayout``
            (``kv_agents`` "per-rank", ``ranks`` advertised).
        dst_staging_block: first block of its staging range for the request.

    Raises:
        ValueError: TPs where neither divides the other, or a layout without ranks.
    """
    dst_tp = dst_layout.tp
    g = max(src_tp, dst_tp)
    if g % src_tp or g % dst_tp:
        raise ValueError(f"prefill TP {src_tp} and decode TP {dst_tp}: one must divide the other")
    if len(dst_layout.ranks) != dst_tp:
        raise ValueError(f"the decode instance advertises {len(dst_layout.ranks)} rank agents for TP {dst_tp}")
    part_bytes = num_blocks * full_block_bytes // g
    dst_block_bytes = full_block_bytes // dst_tp  # one staging block of one decode rank
    wp, dp = g // src_tp, g // dst_tp  # parts per prefill rank, per decode rank
    targets = []
    for r in range(src_tp):
        for j in range(wp):
            part = r * wp + j  # global part
            q, off = divmod(part, dp)
            rk = dst_layout.ranks[q]
            remote = [reg[0] + dst_staging_block * dst_block_bytes + off * part_bytes for reg in rk.staging_regions]
            targets.append(RankTarget(r, rk.agent, j, 1, remote, rk.staging_regions[0][2]))
    return RankSend(request_id, staging_block, num_blocks, wp, part_bytes, targets)


class RankKVWriter:
    """One rank's side of the per-rank KV writes: posts its writes layer by layer,
    reports and releases them. ``staging``: this rank's ``StagingPool``; ``transport``
    its agent (on rank 0 the worker's). Not thread-safe (the rank's main thread)."""

    def __init__(self, transport: NixlTransport, rank: int, staging) -> None:
        self.transport, self.rank, self.staging = transport, rank, staging
        self.plan: list[RankSend] = []
        self.transfers: dict[str, list[Transfer | None]] = {}

    def set_plan(self, plan: KVPlan) -> None:
        self.plan = list(plan.sends)
        for s in self.plan:
            self.transfers.setdefault(s.request_id, [])

    def packs(self) -> dict[int, int]:
        """staging block -> parts, of the current plan (what ``NixlKVRunner._pack`` lays out)."""
        return {s.staging_block: s.parts for s in self.plan}

    def write_layer(self, layer: int) -> None:
        """Post this rank's writes of ``layer`` for every send of the plan (after its pack).
        A write that cannot be posted is kept as None (the request fails on the next poll)."""
        for s in self.plan:
            out = self.transfers[s.request_id]
            for t in s.targets:
                if t.rank != self.rank:
                    continue
                try:
                    addr, nbytes, dev = self.staging.region(layer, s.staging_block, s.num_blocks)
                    length = t.num_parts * s.part_bytes
                    local = (addr + t.part * s.part_bytes, length, dev)
                    out.append(self.transport.write(t.agent, [local], [(t.remote[layer], length, t.device)]))
                except (TransferError, ValueError, IndexError) as e:
                    logger.warning("%s: KV write of %s (layer %d) failed: %s", self.transport.name, s.request_id,
                                   layer, e)
                    out.append(None)

    def end_step(self) -> None:
        self.plan = []

    def state(self, request_id: str) -> int:
        """``WRITE_DONE`` / ``WRITE_PENDING`` / ``WRITE_FAILED`` of this rank's writes of the
        request (unknown ids: done, this rank had none); done ones are forgotten."""
        ts = self.transfers.get(request_id)
        if ts is None:
            return WRITE_DONE
        try:
            if any(t is None for t in ts):
                raise TransferError("a write could not be posted")
            if not all(t.poll() for t in ts):
                return WRITE_PENDING
        except TransferError as e:
            logger.warning("%s: KV write of %s failed: %s", self.transport.name, request_id, e)
            self.release([request_id])
            self.transfers[request_id] = [None]
            return WRITE_FAILED
        del self.transfers[request_id]
        return WRITE_DONE

    def release(self, request_ids: list[str]) -> None:
        """Release (cancel) the requests' writes on this rank and forget them."""
        for rid in request_ids:
            for t in self.transfers.pop(rid, []):
                if t is not None:
                    t.release()

    def add_peers(self, msg: RankPeers) -> None:
        """Load peer agents (writes go to them); a bad one is logged and skipped (its
        writes then fail and the request is retried by the router)."""
        for p in msg.peers:
            if p.agent == self.transport.name:
                continue
            try:
                self.transport.add_peer(p.nixl_metadata, p.regions, p.agent)  # replaces a restarted one
            except (TransferError, ValueError, TypeError) as e:
                logger.warning("%s: could not load peer agent %s: %s", self.transport.name, p.agent, e)
