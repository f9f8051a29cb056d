"""Rank 0 -> the other TP ranks of an instance: the KV connector's messages.

Rank 0 broadcasts these over the instance's gloo/nccl group as msgpack (never pickle),
beside the engine's ``StepInput`` and ``Shutdown`` (``epd.engine.model_runner``);
``KVRankMessage`` is their union. Each rank hands them to its KV runner
(``epd.transfer.kv_runner``): unpack a staged request (``KVUnpack``), and, with per-rank
NIXL agents (``epd.transfer.rank_agent``), the step's writes (``KVPlan``), the state of
requests' writes (``KVPoll``, a gather follows), their release (``KVRelease``) and the
peer agents to load (``RankPeers``).
"""

from __future__ import annotations

import msgspec

from epd.messages.base import Region


class KVUnpack(msgspec.Struct, tag="unpack"):
    """Scatter a staged request's KV (written by a prefill instance of ``src_tp``
    ranks) into ``block_ids`` of every rank's paged cache, all layers."""

    staging_block: int
    block_ids: list[int]
    src_tp: int


class RankTarget(msgspec.Struct, array_like=True, frozen=True):
    """Rank ``rank`` writes ``num_parts`` parts, from part ``part`` of its staging range,
    to agent ``agent``; ``remote[l]``: destination address of layer l (bytes), in memory
    ``device`` of the decode rank (a region's device field: 0 host, 1 + i ``cuda:i``)."""

    rank: int
    agent: str
    part: int
    num_parts: int
    remote: list[int]
    device: int = 0


class RankSend(msgspec.Struct, frozen=True):
    """One request's writes in a step: its staging range (first block ``staging_block``,
    ``num_blocks``; every rank's pool is allocated alike), ``parts`` parts of
    ``part_bytes`` bytes in each rank's range per layer, and the ``targets``."""

    request_id: str
    staging_block: int
    num_blocks: int
    parts: int
    part_bytes: int
    targets: list[RankTarget]


class KVPlan(msgspec.Struct, tag="kv_plan", frozen=True):
    """Rank 0 -> ranks, before a step's ``StepInput``: the step's per-rank KV writes."""

    sends: list[RankSend]


class KVPoll(msgspec.Struct, tag="kv_poll", frozen=True):
    """Rank 0 -> ranks: report the state of these requests' writes (a gather follows)."""

    request_ids: list[str]


class KVRelease(msgspec.Struct, tag="kv_release", frozen=True):
    """Rank 0 -> ranks: release (cancel) these requests' writes and forget them."""

    request_ids: list[str]


class RankPeer(msgspec.Struct, array_like=True, frozen=True):
    """A peer rank's agent: its metadata and the regions writes may touch."""

    agent: str
    nixl_metadata: bytes
    regions: list[Region]


class RankPeers(msgspec.Struct, tag="rank_peers", frozen=True):
    """Rank 0 -> ranks: load (or reload, after a restart) these peer agents."""

    peers: list[RankPeer]


#: every KV message rank 0 broadcasts to its TP ranks
KVRankMessage = KVUnpack | KVPlan | KVPoll | KVRelease | RankPeers
