"""The engine's whole contract with a KV connector: what the engine calls, and what it offers.

The engine knows a KV connector only through these types; the implementation
(``epd.transfer``: ``kv_connector`` for the scheduler side, ``kv_runner`` for each TP
rank's side) is wired in by whoever builds the engine (the workers). Source: vLLM v1
``KVConnectorBase_V1`` (scheduler and worker roles) and
``kv_connector_model_runner_mixin.py``; see docs/architecture.md, "KV connector".

- ``KVConnectorHooks``: rank 0's connector as the engine loop calls it each step
  (``build_step`` -> ``StepKV``) and when a request finishes (``request_finished``).
- ``KVRunnerFactory``: builds the connector's runner side (``KVRunnerBase``) on every
  TP rank; ``LLMEngine`` hands it to each spawned rank.
- ``RankRunner``: what a rank's ``ModelRunner`` offers the runner side (its cache, its
  TP-group collectives).
- ``SchedulerOutput`` (``build_step``'s argument) and ``StepInput`` (``layer_work``'s,
  whose ``kv_packs`` the connector fills) are the engine's data types this contract
  passes; a connector imports them from here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from epd.config import EngineConfig
from epd.engine.scheduler import SchedulerOutput
from epd.engine.step_input import StepInput

__all__ = ["KVConnectorHooks", "KVRunnerBase", "KVRunnerFactory", "LayerWork", "RankRunner", "SchedulerOutput",
           "StepInput", "StepKV"]


@dataclass(slots=True)
class StepKV:
    """Worker-side KV-connector work for one step (what ``KVConnectorHooks.build_step`` returns).

    layer_hook: rank 0, called with layer l once every rank stored (and packed) layer
        l's K/V: right after the store at TP=1; at TP>1 when layer l+1 starts (the
        row-parallel all-reduces of layer l order it after every rank's store) or,
        for the last layer, after the forward.
    kv_packs: see ``StepInput.kv_packs``.
    """

    layer_hook: Callable[[int], None] | None = None
    kv_packs: list[tuple[int, list[int]]] = field(default_factory=list)


class KVConnectorHooks(Protocol):
    """What the engine calls on a KV connector (``epd.transfer.kv_connector``).
    Source: vLLM v1 ``KVConnectorBase_V1``."""

    def build_step(self, sched: SchedulerOutput) -> StepKV | None:
        """This step's per-layer hook and staging packs (None: no KV to move)."""

    def request_finished(self, seq) -> bool:
        """``seq`` just finished; True keeps its blocks (the connector frees them
        once its KV is sent or the send failed)."""


@dataclass(slots=True)
class LayerWork:
    """One rank's KV work in one step, per layer (``KVRunnerBase.layer_work``).

    pack: called with layer l right after the forward stored layer l's K/V (on the
        forward's stream). post: called with layer l once those kernels ran (on a GPU,
        after the layer's event; ``epd.engine.layer_gate``), before rank 0's hook.
    """

    pack: Callable[[int], None]
    post: Callable[[int], None] | None = None


class RankRunner(Protocol):
    """What one TP rank's ``ModelRunner`` offers the KV runner side.

    k_cache / v_cache: [num_layers, num_blocks, block_size, num_kv_heads / tp, row] (see
    ``ModelRunner``). ``in_step``: True while the ranks are in a collective the KV side
    started (a shutdown must then kill the other ranks). The collectives run over the
    instance's TP group; rank 0 calls ``broadcast``, every rank the others, in the same order.
    """

    config: EngineConfig
    rank: int
    device: torch.device
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    in_step: bool

    def broadcast(self, msg: Any) -> None:
        """Rank 0: send ``msg`` (a ``epd.messages.KVRankMessage``) to every other rank."""

    def gather_states(self, mine: torch.Tensor) -> torch.Tensor:
        """[tp, len(mine)] int64: every rank's ``mine`` (rank 0's answer)."""

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""

    def barrier(self) -> None:
        """Wait for every rank."""


class KVRunnerBase(abc.ABC):
    """The KV connector's side on one TP rank (``epd.transfer.kv_runner``): packs the
    step's KV, posts this rank's writes, and serves rank 0's KV messages."""

    @abc.abstractmethod
    def layer_work(self, step: StepInput) -> LayerWork | None:
        """This rank's per-layer work in ``step`` (None: none)."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """The step's forward ended (or failed): forget its plan."""

    @abc.abstractmethod
    def handle(self, msg: Any) -> None:
        """Ranks 1..: serve a KV message rank 0 broadcast (``epd.messages.KVRankMessage``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this rank's side holds (its NIXL agent)."""


class KVRunnerFactory(abc.ABC):
    """Builds the KV runner side of every TP rank of one instance. ``LLMEngine`` calls
    ``prepare`` on rank 0 before it spawns the other ranks, then pickles the factory to
    each of them; every rank calls ``create`` once its ``ModelRunner`` exists, then
    all ranks meet at a barrier, after which rank 0 calls ``started``."""

    @abc.abstractmethod
    def prepare(self, config: EngineConfig, device: torch.device, staging_blocks: int, kv_agents: str,
                instance_id: str | None) -> int:
        """Rank 0 (on ``device``), before the other ranks start: allocate what they share
        (a staging pool of ``staging_blocks`` blocks, 0: none; ``kv_agents`` /
        ``instance_id``: see ``LLMEngine``, which checked them). Returns the tokens of KV
        one request may stage (0: no staging)."""

    @abc.abstractmethod
    def create(self, runner: RankRunner) -> KVRunnerBase:
        """This rank's side, over ``runner`` (a collective when ranks exchange agents)."""

    @abc.abstractmethod
    def started(self) -> None:
        """Rank 0: every rank created its side, or start-up failed: drop shared names."""
