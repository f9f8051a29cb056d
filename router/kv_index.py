"""Which prefill instance holds which KV blocks: the router's prefix index for KV-aware routing.

Prefill (and aggregated ``pd``) workers report their prefix cache's changes as
``KVEvents`` (block hashes stored, removed/evicted, or the whole cache cleared),
batched at most once per heartbeat. The index keeps, per block hash, the set of
instances that hold it. Block hashes are chained (``epd.block_hash.
iter_block_hashes``: each hash covers its parent's hash, so the whole prefix
before it, and the media item hashes of the block), so walking a request's
chain from its first block and stopping at the first miss is a walk down a
radix tree of prefixes whose edges are implicit in the hashes; a flat map
hash -> holders is that tree without the pointer bookkeeping. The router hashes
the request with the same function as the engine, so an instance's overlap is
exactly the number of leading blocks its ``get_computed_blocks`` would hit
(as of its last report).

Tiers: an instance with a host tier (``--kv-host-cache-gb``, and a disk tier
under it) still holds a block evicted from its KV cache, one copy away. Its
reports say where each hash is now (``stored``: the KV cache; ``stored_host``,
``stored_disk``; ``removed``: nowhere), and the index keeps that tier per
instance and hash (``TIERS``), so a routing cost can weigh a hit by what loading
it costs (``tier_counts``).

Reports lag the routing decision (a prefill takes a while, and reports go out
once per heartbeat), so a request that follows another with the same prefix
would otherwise be routed before the first one's blocks are known. As in
Dynamo's approximate mode, the router therefore *predicts*: the chain of each
request it routes counts as held by the chosen instance for
``prediction_ttl_s``, until the instance's own report confirms it (stored)
or contradicts it (removed, cleared, restarted).

Trust: the hashes come from worker processes over the control socket. They
are used for one thing only, choosing where a request runs: a wrong or hostile
hash can make a routing choice worse, never make any worker reuse KV (each
engine looks up its own cache with its own hashes). Reports are checked for
shape (16-byte digests, at most the instance's block count held per instance)
and must come from the process that registered the instance (its
``WorkerReady.pid``); a restarted worker (new pid, same instance id) has its
old entries dropped before anything else is read. The router drops an
instance's entries when the registry declares it dead (silent past the
heartbeat timeout, or exited: it may never come back) and when it
(re-)registers (a new process starts with an empty cache).

Design after NVIDIA Dynamo's KV router (cost = overlap weight x blocks still to
prefill + active blocks; workers publish stored/removed events to an indexer).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from epd.block_hash import iter_block_hashes
from epd.messages import KVEvents

logger = logging.getLogger(__name__)

HASH_BYTES = 16  # xxh3-128 digest
#: cap on hashes held per instance when its KV layout is unknown
DEFAULT_MAX_HASHES = 1 << 20
#: seconds a routed request's blocks count as cached on its instance before its report
PREDICTION_TTL_S = 5.0
#: where an instance holds a block, nearest first (the index stores the position)
TIERS = ("device", "host", "disk")


class KVIndex:
    """Block hash -> instances whose prefix cache holds it, fed by ``KVEvents``.

    ``apply`` takes one report; ``predict`` records a routing decision whose
    report has not come yet; ``overlap`` says, for a request's hash chain, how
    many leading blocks each instance holds (reported or predicted);
    ``drop_instance`` forgets an instance (dead or restarted).
    """

    def __init__(self, prediction_ttl_s: float = PREDICTION_TTL_S) -> None:
        self.holders: dict[bytes, set[str]] = {}
        self.by_instance: dict[str, dict[bytes, int]] = {}  # instance -> {hash: its TIERS position}
        self.pids: dict[str, int] = {}  # the process whose reports the entries came from
        self.prediction_ttl_s = prediction_ttl_s
        self.predicted: dict[bytes, dict[str, float]] = {}  # hash -> {instance: expiry (monotonic s)}
        self._expiry: deque[tuple[float, bytes, str]] = deque()

    def __len__(self) -> int:
        return len(self.holders)

    def num_blocks(self, instance_id: str) -> int:
        """Block hashes the index holds for ``instance_id``."""
        return len(self.by_instance.get(instance_id, ()))

    def drop_instance(self, instance_id: str) -> None:
        """Forget everything ``instance_id`` reported, and every prediction about it."""
        for h in self.by_instance.pop(instance_id, ()):
            held = self.holders.get(h)
            if held is not None:
                held.discard(instance_id)
                if not held:
                    del self.holders[h]
        self.pids.pop(instance_id, None)
        for h in [h for h, insts in self.predicted.items() if instance_id in insts]:
            self._unpredict(h, instance_id)

    # ---- predictions --------------------------------------------------------------
    def predict(self, instance_id: str, chain: Iterable[bytes], now: float | None = None) -> None:
        """Count ``chain`` (the hashes of a request just routed to ``instance_id``) as
        held there for ``prediction_ttl_s`` seconds from ``now`` (monotonic)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        expiry = now + self.prediction_ttl_s
        for h in chain:
            self.predicted.setdefault(h, {})[instance_id] = expiry
            self._expiry.append((expiry, h, instance_id))

    def _unpredict(self, h: bytes, instance_id: str) -> None:
        insts = self.predicted.get(h)
        if insts is not None:
            insts.pop(instance_id, None)
            if not insts:
                del self.predicted[h]

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expiry, h, inst = self._expiry.popleft()
            if self.predicted.get(h, {}).get(inst) == expiry:  # not renewed since
                self._unpredict(h, inst)

    def sync_pid(self, instance_id: str, pid: int) -> None:
        """Drop ``instance_id``'s entries if they came from another process than ``pid``
        (the worker restarted: its new process starts with an empty cache)."""
        old = self.pids.get(instance_id)
        if old is not None and old != pid:
            self.drop_instance(instance_id)

    def apply(self, ev: KVEvents, registered_pid: int | None, max_hashes: int | None = None) -> bool:
        """Apply one report: forget all of the instance's hashes if ``ev.cleared``,
        then remove ``ev.removed``, then set ``ev.stored`` (device),
        ``ev.stored_host`` and ``ev.stored_disk`` with their tier.

        ``registered_pid``: the pid of the instance's current ``WorkerReady`` (None:
        unknown instance). ``max_hashes``: the blocks its KV cache and tiers hold (it
        cannot cache more distinct blocks). Returns False, changing nothing, for a report
        from an unknown instance or another process, or one with a malformed hash;
        an instance over ``max_hashes`` has all its entries dropped.
        """
        inst = ev.instance_id
        if registered_pid is None or ev.pid != registered_pid:
            return False
        if any(len(h) != HASH_BYTES for hashes in (ev.stored, ev.removed, ev.stored_host, ev.stored_disk)
               for h in hashes):
            logger.warning("KV events from %s dropped: block hashes must be %d bytes", inst, HASH_BYTES)
            return False
        self.sync_pid(inst, ev.pid)
        self.pids[inst] = ev.pid
        if ev.cleared:
            self.drop_instance(inst)
            self.pids[inst] = ev.pid
        mine = self.by_instance.setdefault(inst, {})
        for h in ev.removed:
            self._unpredict(h, inst)
            if mine.pop(h, None) is not None:
                held = self.holders[h]
                held.discard(inst)
                if not held:
                    del self.holders[h]
        for tier, hashes in enumerate((ev.stored, ev.stored_host, ev.stored_disk)):
            for h in hashes:
                self._unpredict(h, inst)  # reported: where it really is wins over the prediction
                if h not in mine:
                    self.holders.setdefault(h, set()).add(inst)
                mine[h] = tier
        cap = max_hashes if max_hashes is not None else DEFAULT_MAX_HASHES
        if len(mine) > cap:
            logger.warning("KV events from %s claim %d cached blocks of %d: its index entries are dropped",
                           inst, len(mine), cap)
            self.drop_instance(inst)
        return True

    def tier_counts(self, chain: Iterable[bytes], instance_id: str, num_blocks: int) -> list[int]:
        """Of the first ``num_blocks`` hashes of ``chain`` (an overlap), how many
        ``instance_id`` holds in each of ``TIERS``, as reported; a predicted one counts
        as on the device (it will be once the routed request ran)."""
        mine = self.by_instance.get(instance_id, {})
        counts = [0] * len(TIERS)
        for _, h in zip(range(num_blocks), chain):
            counts[mine.get(h, 0)] += 1
        return counts

    def device_overlap(self, chain: Iterable[bytes], instance_id: str) -> int:
        """Leading blocks of ``chain`` that ``instance_id`` reported in its KV cache (the
        device tier; predictions not counted): what a remote prefix read can take from it."""
        mine = self.by_instance.get(instance_id, {})
        n = 0
        for h in chain:
            if mine.get(h) != 0:
                break
            n += 1
        return n

    def overlap(self, chain: Iterable[bytes], instances: Iterable[str], now: float | None = None) -> dict[str, int]:
        """Leading blocks of ``chain`` (a request's block hashes, first block first)
        that each of ``instances`` holds, as reported or predicted at ``now``
        (monotonic s): ``{instance_id: num_blocks}``."""
        self._expire(time.monotonic() if now is None else now)
        active = set(instances)
        out = dict.fromkeys(active, 0)
        depth = 0
        for h in chain:
            if not active:
                break
            held = self.holders.get(h, set())
            predicted = self.predicted.get(h)
            active &= held | predicted.keys() if predicted else held
            depth += 1
            for inst in active:
                out[inst] = depth
        return out


def request_block_hashes(prompt_token_ids: list[int], block_size: int, placeholders=()) -> list[bytes]:
    """The hash chain an engine with ``block_size`` would look up for this prompt:
    its first ``(len - 1) // block_size`` full blocks (the engine always leaves one
    token to compute), media item hashes mixed in exactly as the engine does."""
    n = (len(prompt_token_ids) - 1) // block_size if prompt_token_ids else 0
    return list(iter_block_hashes(prompt_token_ids, block_size, placeholders, n))
