"""Routing policies: which instance of a pool gets a request.

One policy object per pool, chosen by ``epd launch`` flags
(``--encode-routing``, ``--prefill-routing``, ``--decode-routing``; the
aggregated ``pd`` pool follows ``--prefill-routing``):

- ``round-robin``: live instances in instance-id order, in turn.
- ``least-loaded``: fewest open requests routed there, then fewest running +
  waiting sequences in its last heartbeat, then most free KV blocks.
- ``kv`` (prefill / pd): lowest cost = overlap weight x blocks still to prefill
  there + the blocks of the requests already open there, where the overlap
  comes from the prefix index of reported KV cache events
  (``epd.router.kv_index``); after NVIDIA Dynamo's KV router.
- ``free-kv`` (decode): most free KV blocks after the reservations routed there
  that its last heartbeat does not reflect yet, plus the prompt blocks it would
  not receive (decode-side reuse: the leading blocks its prefix cache holds, per
  the decode instances' KV events), then smallest running batch.
- ``media-affinity`` (encode): rendezvous (highest-random-weight) hashing of the
  request's first media item hash over the live encoders, so a repeated image
  or clip lands on the encoder whose cache holds its embedding; least-loaded
  when that encoder is overloaded or the request has no items.

Every policy is deterministic: ties break on the instance id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from epd.messages import Heartbeat
from epd.roles import Role
from epd.router.kv_index import KVIndex, request_block_hashes
from epd.router.registry import WorkerHandle

if TYPE_CHECKING:
    from epd.router.request import RouterRequest

#: policy names each pool accepts; the first is the default
POLICIES: dict[str, tuple[str, ...]] = {
    Role.ENCODE: ("media-affinity", "least-loaded", "round-robin"),
    Role.PREFILL: ("kv", "least-loaded", "round-robin"),
    Role.PD: ("kv", "least-loaded", "round-robin"),
    Role.DECODE: ("free-kv", "least-loaded", "round-robin"),
    Role.TTS: ("least-loaded", "round-robin"),
}


class NoInstanceError(RuntimeError):
    """No live instance in a pool: requests fail fast (HTTP 503) instead of waiting."""


def _busy(w: WorkerHandle) -> int:
    return (w.load.num_running + w.load.num_waiting) if w.load else 0


def least_loaded(workers: list[WorkerHandle]) -> WorkerHandle:
    """The instance with the fewest requests routed to it and still open, then
    the fewest running+waiting sequences in its last heartbeat, then most free blocks.

    Raises:
        NoInstanceError: ``workers`` is empty.
    """
    if not workers:
        raise NoInstanceError("no live instance")

    def key(w: WorkerHandle):
        free = w.load.num_free_blocks if w.load else 0
        return (w.inflight, _busy(w), -free, w.instance_id)

    return min(workers, key=key)


class RoutingPolicy:
    """Picks one of a pool's live instances for a request."""

    name = "base"

    def select(self, workers: list[WorkerHandle], req: RouterRequest | None = None) -> WorkerHandle:
        """One of ``workers`` (the pool's live instances) for ``req``.

        Raises:
            NoInstanceError: ``workers`` is empty.
        """
        raise NotImplementedError

    def reserved(self, w: WorkerHandle, request_id: str) -> None:
        """``w`` answered ``request_id``'s ``ReserveKV`` (``KVReserved``): its blocks are taken."""

    def released(self, w: WorkerHandle, request_id: str) -> None:
        """The attempt ``request_id`` routed to ``w`` ended (finished, failed or aborted)."""

    def forget(self, instance_id: str) -> None:
        """The router forgot the dead instance ``instance_id``: drop what is kept about it."""


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def select(self, workers, req=None):
        return least_loaded(workers)


class RoundRobin(RoutingPolicy):
    """Live instances sorted by id, taken in turn (a dead one is skipped, not waited for)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers, req=None):
        if not workers:
            raise NoInstanceError("no live instance")
        ordered = sorted(workers, key=lambda w: w.instance_id)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        return w


#: what loading one block back from each of ``epd.router.kv_index.TIERS`` costs, as a share
#: of prefilling it. Measured by ``benchmarks/kv_tier_costs.py`` (SmolLM2-135M, bf16, 16-token
#: blocks, 2 CPU cores): host 0.003, disk 0.009 from the page cache and 0.046 from the device;
#: rounded up. On a GPU the prefill is far faster per block while a PCIe copy is not, so the
#: shares grow; the ordering (device < host < disk << prefill) is what routing relies on.
TIER_BLOCK_COST = (0.0, 0.005, 0.05)


def tier_load_blocks(index: KVIndex, chain: list[bytes], instance_id: str, overlap: int) -> float:
    """What loading the first ``overlap`` blocks of ``chain`` on ``instance_id`` back from
    its tiers costs, in blocks of prefill (``TIER_BLOCK_COST`` per block and tier)."""
    if not overlap:
        return 0.0
    return sum(c * n for c, n in zip(TIER_BLOCK_COST, index.tier_counts(chain, instance_id, overlap)))


#: what reading one block from another prefill instance's KV cache over NIXL costs, as a
#: share of prefilling it (``epd.transfer.remote_prefix``), and the fewest blocks worth a
#: read. Measured by ``benchmarks/kv_tier_costs.py`` (SmolLM2-135M bf16, 16-token blocks,
#: 2 CPU cores, two agents on one host): a 16-block READ takes 0.40 ms per block (0.021 of
#: its prefill), rounded up; the pin round trip itself is 0.04 ms, but the holder answers
#: between its engine steps, so a read waits for the holder's current step: below 4 blocks
#: that wait can cost more than the prefill it saves.
REMOTE_BLOCK_COST = 0.025
REMOTE_READ_MIN_BLOCKS = 4


def prefix_holder(index: KVIndex, chain: list[bytes], w: WorkerHandle, workers: list[WorkerHandle]
                  ) -> tuple[str, int, int]:
    """The instance of ``workers`` (not ``w``) whose KV cache holds the most leading
    blocks of ``chain`` (reported), with blocks moving to ``w`` as they are
    (``KVLayout.same_blocks``): (its id, the leading blocks it holds, how many more than
    ``w`` holds anywhere, reported or predicted); ("", 0, 0) when none holds
    ``REMOTE_READ_MIN_BLOCKS`` more."""
    layout = w.info.kv_layout
    if layout is None or not chain:
        return "", 0, 0
    mine = index.overlap(chain, [w.instance_id])[w.instance_id]
    best, held = "", 0
    for h in sorted(workers, key=lambda x: x.instance_id):
        if h is w or not layout.same_blocks(h.info.kv_layout):
            continue
        index.sync_pid(h.instance_id, h.info.pid)
        n = index.device_overlap(chain, h.instance_id)
        if n > held:
            best, held = h.instance_id, n
    return (best, held, held - mine) if held - mine >= REMOTE_READ_MIN_BLOCKS else ("", 0, 0)


class KVAwarePrefill(RoutingPolicy):
    """Lowest ``overlap_weight x new_blocks + open_blocks`` (Dynamo's KV router cost).

    ``new_blocks``: the request's KV blocks (ceil(prompt tokens / block size))
    minus the leading blocks the instance already caches, per the prefix index
    (reported, or predicted from the requests routed there; the chosen
    instance's prediction is recorded on each pick), plus, for each of those it
    holds only in its host or disk tier, the share of a block's prefill that
    loading it back costs (``TIER_BLOCK_COST``). With ``remote_reads``, blocks past those
    that another instance's KV cache holds (``prefix_holder``) count as read from there
    (``REMOTE_BLOCK_COST`` each), not prefilled: the score counts a prefix held anywhere
    in the pool, weighted by where it is, so a busy holder's prefix still helps the others.
    ``open_blocks``: prompt blocks of the requests routed to the instance that
    are still open there (the router's ``inflight`` count of them, newest
    kept: requests in a prefill pool finish about in arrival order), the
    load term in the same unit. Ties: fewer open blocks, fewer open requests,
    fewer requests routed there so far (spreads new prefixes over the pool
    without waiting for the first one's KV events), instance id.
    Without block size or prompt (e.g. a transcription) it is least-loaded.
    """

    name = "kv"

    def __init__(self, index: KVIndex, overlap_weight: float = 1.0, remote_reads: bool = True) -> None:
        if overlap_weight < 0:
            raise ValueError(f"kv overlap weight must be >= 0, got {overlap_weight}")
        self.index = index
        self.overlap_weight = overlap_weight
        self.remote_reads = remote_reads
        self._open: dict[str, deque[int]] = {}
        self._routed: dict[str, int] = {}

    def forget(self, instance_id: str) -> None:
        self._open.pop(instance_id, None)
        self._routed.pop(instance_id, None)

    def open_blocks(self, w: WorkerHandle) -> int:
        """Blocks of the requests still open on ``w`` (router view)."""
        q = self._open.get(w.instance_id)
        if not q:
            return 0
        while len(q) > max(w.inflight, 0):
            q.popleft()
        return sum(q)

    def costs(self, workers: list[WorkerHandle], req: RouterRequest,
              chains: dict[int, list[bytes]] | None = None) -> dict[str, tuple[float, int, int]]:
        """Per instance: (cost, request blocks on that instance's block size, overlap blocks).
        ``chains``: filled with the request's hash chain per block size."""
        chains = {} if chains is None else chains
        out = {}
        for w in workers:
            self.index.sync_pid(w.instance_id, w.info.pid)
        for w in workers:
            layout = w.info.kv_layout
            bs = layout.block_size if layout is not None else 0
            total = -(-len(req.prompt_token_ids) // bs) if bs else 0
            overlap = 0
            if bs:
                if bs not in chains:
                    chains[bs] = request_block_hashes(req.prompt_token_ids, bs, req.placeholders)
                overlap = self.index.overlap(chains[bs], [w.instance_id])[w.instance_id]
            load = tier_load_blocks(self.index, chains[bs], w.instance_id, overlap) if bs else 0.0
            if bs and self.remote_reads:
                remote = prefix_holder(self.index, chains[bs], w, workers)[2]
                load += remote * REMOTE_BLOCK_COST
                overlap += remote
            out[w.instance_id] = (self.overlap_weight * (total - overlap + load) + self.open_blocks(w), total, overlap)
        return out

    def select(self, workers, req=None):
        if not workers:
            raise NoInstanceError("no live instance")
        if req is None or not req.prompt_token_ids:
            return least_loaded(workers)
        chains: dict[int, list[bytes]] = {}
        costs = self.costs(workers, req, chains)

        def key(w: WorkerHandle):
            return (costs[w.instance_id][0], self.open_blocks(w), w.inflight,
                    self._routed.get(w.instance_id, 0), w.instance_id)

        w = min(workers, key=key)
        total, overlap = costs[w.instance_id][1:]
        self._open.setdefault(w.instance_id, deque()).append(total - overlap)
        self._routed[w.instance_id] = self._routed.get(w.instance_id, 0) + 1
        layout = w.info.kv_layout
        if layout is not None:  # its blocks will be there once it ran (confirmed by its report)
            self.index.predict(w.instance_id, chains[layout.block_size])
        return w


@dataclass(slots=True)
class _Reservation:
    """A request routed to a decode instance, as ``FreeKVDecode`` counts it."""

    request_id: str  # the attempt's wire id
    blocks: int  # prompt blocks, on the instance's block size
    pid: int  # the instance's process it was routed to
    acked: bool = False  # its KVReserved arrived
    at: Heartbeat | None = None  # the instance's latest report when it did


class FreeKVDecode(RoutingPolicy):
    """Most free KV blocks after reservations, then smallest running batch.

    Free blocks come from the instance's last heartbeat; the prompt blocks of
    the requests routed to it that this heartbeat does not reflect yet are
    subtracted (``pending``). A reservation is reflected by a load report made
    after the worker took its blocks, i.e. after its ``KVReserved``: one
    numbered above the report the router had when ``KVReserved`` arrived
    (``Heartbeat.seq``; the reply and the worker loop's reports share one
    socket, so every earlier report came first), or, from a worker that does
    not number its reports, a later one with other values (one with the same
    values keeps it pending: the safe side). Before ``KVReserved`` no report
    reflects it, whether it changed, repeats (the heartbeat thread repeats the
    latest report while the loop is busy) or is late. A reservation leaves when
    its attempt ends (``released``) or its instance's process is replaced.
    Block counts use the instance's block size.

    With a prefix ``index`` (the decode instances report their prefix caches when
    decode-side reuse is on), the blocks an instance would reuse count as free too
    (each held only in a host or disk tier less its load cost, ``TIER_BLOCK_COST``):
    they are the KV it need not receive. A conversation's next turn then goes where
    its last one was decoded unless another instance has more free blocks than that
    saves; with no prefix anywhere this is plain free-kv.
    """

    name = "free-kv"

    def __init__(self, index: KVIndex | None = None) -> None:
        self.index = index
        self._reservations: dict[str, list[_Reservation]] = {}  # instance -> routed, not yet reflected

    @staticmethod
    def _reflects(load: Heartbeat | None, r: _Reservation) -> bool:
        """The instance's report ``load`` includes reservation ``r``."""
        if not r.acked or load is None:
            return False
        if r.at is None:
            return True
        if load.seq or r.at.seq:
            return load.seq > r.at.seq
        return load != r.at

    def pending(self, w: WorkerHandle) -> list[int]:
        """Blocks of each reservation routed to ``w`` that its last heartbeat does not reflect."""
        rs = self._reservations.get(w.instance_id)
        if not rs:
            return []
        rs[:] = [r for r in rs if r.pid == w.info.pid and not self._reflects(w.load, r)]
        return [r.blocks for r in rs]

    def reserved(self, w: WorkerHandle, request_id: str) -> None:
        for r in self._reservations.get(w.instance_id, ()):
            if r.request_id == request_id and not r.acked:
                r.acked, r.at = True, w.load
                return

    def released(self, w: WorkerHandle, request_id: str) -> None:
        rs = self._reservations.get(w.instance_id)
        if rs:
            rs[:] = [r for r in rs if r.request_id != request_id]

    def forget(self, instance_id: str) -> None:
        self._reservations.pop(instance_id, None)

    def free_after_reservations(self, w: WorkerHandle) -> int:
        free = w.load.num_free_blocks if w.load else 0
        return free - sum(self.pending(w))

    def reused_blocks(self, w: WorkerHandle, req: RouterRequest | None, chains: dict[int, list[bytes]]) -> float:
        """Leading prompt blocks of ``req`` that ``w``'s prefix cache holds (reported or
        predicted), each in a host or disk tier counted less its load cost; 0 from an
        instance that never reported its cache (decode-side reuse off there: its
        predictions would promise reuse it does not do)."""
        layout = w.info.kv_layout
        if self.index is None or req is None or not req.prompt_token_ids or layout is None:
            return 0.0
        self.index.sync_pid(w.instance_id, w.info.pid)
        if w.instance_id not in self.index.pids:
            return 0.0
        bs = layout.block_size
        if bs not in chains:
            chains[bs] = request_block_hashes(req.prompt_token_ids, bs, req.placeholders)
        overlap = self.index.overlap(chains[bs], [w.instance_id])[w.instance_id]
        return overlap - tier_load_blocks(self.index, chains[bs], w.instance_id, overlap)

    def select(self, workers, req=None):
        if not workers:
            raise NoInstanceError("no live instance")
        chains: dict[int, list[bytes]] = {}
        reused = {w.instance_id: self.reused_blocks(w, req, chains) for w in workers}

        def key(w: WorkerHandle):
            running = (w.load.num_running if w.load else 0) + len(self.pending(w))
            return (-(self.free_after_reservations(w) + reused[w.instance_id]), running, w.inflight, w.instance_id)

        w = min(workers, key=key)
        layout = w.info.kv_layout
        if req is not None and layout is not None:
            blocks = -(-len(req.prompt_token_ids) // layout.block_size)
            self._reservations.setdefault(w.instance_id, []).append(_Reservation(req.request_id, blocks, w.info.pid))
            if self.index is not None and req.prompt_token_ids:  # its prompt will be cached there
                self.index.predict(w.instance_id, chains.get(layout.block_size) or request_block_hashes(
                    req.prompt_token_ids, layout.block_size, req.placeholders))
        return w


class MediaAffinity(RoutingPolicy):
    """Rendezvous hashing on the first media item's hash, so the same item meets the same encoder cache.

    Each live encoder scores xxh3-64(item hash, instance id); the highest wins.
    When an instance leaves or joins, only the items that scored it highest
    move. ``overload_slack``: the winner is skipped for least-loaded when it has
    that many more open requests than the least busy encoder.
    """

    name = "media-affinity"

    def __init__(self, overload_slack: int = 4) -> None:
        if overload_slack < 1:
            raise ValueError(f"overload slack must be >= 1, got {overload_slack}")
        self.overload_slack = overload_slack

    @staticmethod
    def score(item_hash: str, instance_id: str) -> int:
        return xxhash.xxh3_64_intdigest(f"{item_hash}\x1f{instance_id}".encode())

    def select(self, workers, req=None):
        if not workers:
            raise NoInstanceError("no live instance")
        if req is None or not req.items:
            return least_loaded(workers)
        item = req.items[0].item_hash
        w = max(workers, key=lambda w: (self.score(item, w.instance_id), w.instance_id))
        if w.inflight - min(x.inflight for x in workers) >= self.overload_slack:
            return least_loaded(workers)
        return w


def build_policy(role: str, name: str | None, kv_index: KVIndex | None = None,
                 kv_overlap_weight: float = 1.0, remote_prefix_reads: bool = True) -> RoutingPolicy:
    """The policy ``name`` (None: the pool's default) for pool ``role``.

    Raises:
        ValueError: unknown role, or a policy the pool does not take.
    """
    if role not in POLICIES:
        raise ValueError(f"unknown pool {role!r}; expected one of {sorted(POLICIES)}")
    name = name or POLICIES[role][0]
    if name not in POLICIES[role]:
        raise ValueError(f"{role} routing {name!r} is not one of {', '.join(POLICIES[role])}")
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "kv":
        return KVAwarePrefill(kv_index if kv_index is not None else KVIndex(), kv_overlap_weight,
                              remote_prefix_reads and role == Role.PREFILL)
    if name == "free-kv":
        return FreeKVDecode(kv_index)
    return MediaAffinity()
