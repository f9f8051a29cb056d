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
from dataclasses import dataclass, field

import torch

from epd.engine.kv_connector_base import SchedulerOutput, StepKV
from epd.messages import KVLayout, Message, PrefillRequest, RankKV, ReserveKV
from epd.outputs import RequestOutput
from epd.sequence import Sequence
from epd.transfer.nixl_transport import Transfer
from epd.transfer.regions import layer_regions
from epd.transfer.staging import StagingPool

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

__all__ = ["KVReceiver", "KVSend", "KVSender", "kv_layout"]


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
        """``num_quarantined``: aborted reservations still fenced for their writer;
        ``kv_reused_blocks``: prompt blocks this instance's prefix cache held, so no
        prefill worker wrote them (decode-side reuse)."""


# ---- a send in flight ------------------------------------------------------------------
@dataclass(slots=True)
class KVSend:
    """One request's prompt KV on its way to ``decode_instance``.

    ``dst_block_ids``: the decode instance's reserved blocks, for the prompt's blocks
    from ``dst_first_block`` on (those before it the decode instance's prefix cache
    already held); ``dst_staging_block``:
    first block of its staging range (-1: block to block); ``staging_block``: ours.
    ``seq``: the finished prompt, whose blocks are held until the send ends.
    """

    request_id: str
    decode_instance: str
    dst_block_ids: list[int]
    dst_staging_block: int
    dst_generation: int
    arrival: float
    dst_first_block: int = 0
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
