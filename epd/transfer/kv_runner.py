"""The KV connector's side on each TP rank: staging packs and unpacks, per-rank writes.

``NixlKVRunnerFactory`` (``epd.engine.kv_connector_base.KVRunnerFactory``) is what a
worker hands ``LLMEngine``: on rank 0 it allocates the instance's staging pool
(``epd.transfer.staging``) before the other ranks spawn; on every rank it builds a
``NixlKVRunner`` over that rank's ``ModelRunner``. With per-rank agents
(``--kv-agents per-rank``, ``epd.transfer.rank_agent``) rank r > 0 also creates its own
NIXL agent (``<instance>.tp<r>``), registers its KV cache and private staging pool, and
sends its ``RankKV`` to rank 0 (``NixlKVRunner.rank_kv`` there).

Rank 0's ``NixlKVRunner`` is what the connector (``epd.transfer.kv_connector``) drives:
``unpack_kv`` (decode side), ``set_kv_plan`` / ``poll_kv`` / ``release_kv`` /
``add_rank_peers`` (per-rank agents); each broadcasts an ``epd.messages.KVRankMessage``
that the other ranks' runners serve in ``handle``. Source: vLLM v1
``kv_connector_model_runner_mixin.py``.
"""

from __future__ import annotations

import msgspec
import torch

from epd.config import EngineConfig
from epd.engine.kv_connector_base import KVRunnerBase, KVRunnerFactory, LayerWork, RankRunner, StepInput
from epd.kernels.kv_staging import pack_kv, staging_shape, unpack_kv
from epd.messages import KVPlan, KVPoll, KVRelease, KVUnpack, RankKV, RankPeers
from epd.transfer.nixl_transport import NixlTransport
from epd.transfer.rank_agent import RankKVWriter, rank_agent_name
from epd.transfer.regions import layer_regions
from epd.transfer.staging import StagingPool

__all__ = ["NixlKVRunner", "NixlKVRunnerFactory"]


class NixlKVRunner(KVRunnerBase):
    """One TP rank's KV side over its ``runner`` (``RankRunner``).

    ``staging``: the instance's staging pool, mapped by every rank, or None when the
    instance moves KV block to block only. ``kv_agents``: "rank0" (that shared pool,
    moved by rank 0's agent) or "per-rank" (``staging`` is this rank's private pool of
    its own KV heads, and ``writer``, set once this rank's NIXL agent exists, posts its
    writes: ``epd.transfer.rank_agent``). ``transport``: the NIXL agent this rank created
    (ranks > 0 with per-rank agents; rank 0's is the worker's). ``rank_kv``: rank 0,
    per-rank agents: every other rank's ``RankKV``.
    """

    def __init__(self, runner: RankRunner, staging: StagingPool | None, kv_agents: str) -> None:
        self.runner = runner
        self.staging = staging
        self.kv_agents = kv_agents
        self.writer: RankKVWriter | None = None
        self.transport: NixlTransport | None = None
        self.rank_kv: list[RankKV] = []
        self.rank_requests = 0  # NIXL requests posted by ranks 1.. (per-rank agents; as of the last poll_kv)

    @property
    def _tp(self) -> int:
        return self.runner.config.tensor_parallel_size

    # ---- rank 0 -------------------------------------------------------
    def unpack_kv(self, staging_block: int, block_ids: list[int], src_tp: int) -> None:
        """Scatter a request's staged KV (every layer) into ``block_ids`` of every
        rank's cache, each rank taking its own head slice; returns when all ranks
        are done. The staging region is laid out by ``src_tp`` prefill ranks
        (``epd.kernels.kv_staging``)."""
        msg = KVUnpack(staging_block, list(block_ids), src_tp)
        self.runner.in_step = True
        if self._tp > 1:
            self.runner.broadcast(msg)
        self._unpack(msg)
        if self._tp > 1:
            self.runner.barrier()
        self.runner.in_step = False

    def set_kv_plan(self, plan: KVPlan) -> None:
        """Give every rank the next step's per-rank KV writes (call before the step)."""
        if self._tp > 1:
            self.runner.broadcast(plan)
        self.writer.set_plan(plan)

    def poll_kv(self, request_ids: list[str]) -> list[int]:
        """The state of each request's writes over every rank (``WRITE_DONE`` <
        ``WRITE_PENDING`` < ``WRITE_FAILED``: the worst rank's); updates ``rank_requests``."""
        mine = [self.writer.state(r) for r in request_ids]
        if self._tp == 1:
            return mine
        self.runner.in_step = True
        self.runner.broadcast(KVPoll(list(request_ids)))
        got = self.runner.gather_states(torch.tensor([*mine, 0], dtype=torch.long))
        self.runner.in_step = False
        self.rank_requests = int(got[1:, -1].sum())
        return [int(v) for v in got[:, :-1].max(dim=0).values]

    def release_kv(self, request_ids: list[str]) -> None:
        """Release (cancel) the requests' writes on every rank."""
        if self._tp > 1:
            self.runner.broadcast(KVRelease(list(request_ids)))
        self.writer.release(list(request_ids))

    def add_rank_peers(self, msg: RankPeers) -> None:
        """Load peer agents into ranks 1.. (rank 0's agent loads its own)."""
        if self._tp > 1:
            self.runner.broadcast(msg)

    # ---- every rank ---------------------------------------------------
    def layer_work(self, step: StepInput) -> LayerWork | None:
        """Pack this rank's part of ``step.kv_packs`` layer by layer; with per-rank
        agents, post this rank's writes of each packed layer."""
        packs = step.kv_packs
        if not packs:
            return None
        writer = self.writer if self.kv_agents == "per-rank" else None
        return LayerWork(lambda layer: self._pack(layer, packs), writer.write_layer if writer is not None else None)

    def end_step(self) -> None:
        if self.writer is not None:
            self.writer.end_step()

    def handle(self, msg) -> None:
        """Ranks 1..: serve a ``KVRankMessage`` rank 0 broadcast (``KVUnpack`` ends in a
        barrier, ``KVPoll`` in a gather of every rank's states)."""
        if isinstance(msg, KVUnpack):
            self._unpack(msg)
            self.runner.barrier()
        elif isinstance(msg, KVPlan):
            self.writer.set_plan(msg)
        elif isinstance(msg, KVPoll):
            states = [self.writer.state(r) for r in msg.request_ids]
            self.runner.gather_states(torch.tensor([*states, self.transport.num_requests], dtype=torch.long))
        elif isinstance(msg, KVRelease):
            self.writer.release(msg.request_ids)
        elif isinstance(msg, RankPeers):
            self.writer.add_peers(msg)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _staged(self, layer: int, start: int, n: int, src_tp: int) -> torch.Tensor:
        """The shared pool's region [src_tp, 2, n, block_size, heads / src_tp, row] of every rank."""
        c = self.runner.config
        view = self.staging.view(layer, start, n)
        return view.view(staging_shape(src_tp, n, c.block_size, c.num_kv_heads, c.kv_row_elems))

    def _own_staged(self, layer: int, start: int, n: int, parts: int) -> torch.Tensor:
        """Per-rank agents: this rank's region [parts, 2, n, block_size, heads_of_rank / parts, row]."""
        c = self.runner.config
        view = self.staging.view(layer, start, n)
        return view.view(staging_shape(parts, n, c.block_size, self.runner.k_cache.shape[3], c.kv_row_elems))

    def _pack(self, layer: int, packs: list[tuple[int, list[int]]]) -> None:
        r = self.runner
        if self.kv_agents == "per-rank":
            parts_of = self.writer.packs()
            for start, ids in packs:
                parts = parts_of[start]
                out = self._own_staged(layer, start, len(ids), parts)
                hp = r.k_cache.shape[3] // parts
                ids_t = torch.tensor(ids, device=r.device)
                for j in range(parts):  # part j: heads [j * hp, (j + 1) * hp) of this rank
                    k, v = r.k_cache[layer], r.v_cache[layer]
                    if parts > 1:
                        k, v = k[:, :, j * hp:(j + 1) * hp], v[:, :, j * hp:(j + 1) * hp]
                    pack_kv(k, v, ids_t, out[j])
            return
        for start, ids in packs:
            part = self._staged(layer, start, len(ids), self._tp)[r.rank]
            pack_kv(r.k_cache[layer], r.v_cache[layer], torch.tensor(ids, device=r.device), part)

    @torch.inference_mode()
    def _unpack(self, msg: KVUnpack) -> None:
        r = self.runner
        ids = torch.tensor(msg.block_ids, device=r.device)
        heads = r.k_cache.shape[3]
        for layer in range(r.k_cache.shape[0]):
            if self.kv_agents == "per-rank":  # this rank's heads only, in src_tp / tp parts (or one)
                src = self._own_staged(layer, msg.staging_block, len(msg.block_ids), max(1, msg.src_tp // self._tp))
                unpack_kv(src, r.k_cache[layer], r.v_cache[layer], ids, 0)
            else:
                src = self._staged(layer, msg.staging_block, len(msg.block_ids), msg.src_tp)
                unpack_kv(src, r.k_cache[layer], r.v_cache[layer], ids, r.rank * heads)


class NixlKVRunnerFactory(KVRunnerFactory):
    """Builds ``NixlKVRunner`` on every TP rank. Picklable once prepared: rank 0's staging
    pool stays on rank 0, the other ranks map it from ``staging_args``
    (``(num_layers, num_blocks, block_elems, shm_path)``; ``shm_path`` None: each rank a
    private pool of its own heads, per-rank agents)."""

    def __init__(self) -> None:
        self.kv_agents = "rank0"
        self.instance_id: str | None = None
        self.staging_args: tuple | None = None
        self._pool: StagingPool | None = None  # rank 0 only

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}

    def prepare(self, config: EngineConfig, device: torch.device, staging_blocks: int, kv_agents: str,
                instance_id: str | None) -> int:
        self.kv_agents, self.instance_id = kv_agents, instance_id
        if staging_blocks <= 0:
            return 0
        per_rank = kv_agents == "per-rank"
        tp = config.tensor_parallel_size
        layers = config.text_config.num_hidden_layers
        elems = 2 * config.block_size * config.num_kv_heads * config.kv_row_elems
        if per_rank:
            elems //= tp  # this rank's heads only, in its own memory
        path = StagingPool.new_shm_path("tp") if tp > 1 and not per_rank else None
        self._pool = StagingPool(layers, staging_blocks, elems, config.kv_storage_dtype, shm_path=path,
                                 device=device)
        self.staging_args = (layers, staging_blocks, elems, path)
        return staging_blocks * config.block_size

    def create(self, runner: RankRunner) -> NixlKVRunner:
        config, rank = runner.config, runner.rank
        staging = self._pool if rank == 0 else None
        if rank > 0 and self.staging_args is not None:
            layers, blocks, elems, path = self.staging_args
            staging = StagingPool(layers, blocks, elems, config.kv_storage_dtype, shm_path=path, create=False,
                                  device=runner.device)
        kv = NixlKVRunner(runner, staging, self.kv_agents)
        if self.kv_agents != "per-rank" or config.tensor_parallel_size == 1:
            return kv
        if rank == 0:  # every other rank creates its agent: collect what it registered
            kv.rank_kv = [msgspec.msgpack.decode(b, type=RankKV) for b in runner.all_gather_bytes(b"")[1:]]
            return kv
        # A progress thread (1 ms sleep): this process blocks in the TP group between steps, while
        # UCX needs the target of a write to progress, and this rank's writes may outlive its step.
        transport = NixlTransport(rank_agent_name(self.instance_id, rank), progress_thread_us=1000)
        transport.register([runner.k_cache, runner.v_cache] + ([staging.buffer] if staging is not None else []))
        info = RankKV(transport.name, transport.metadata(), layer_regions(runner.k_cache),
                      layer_regions(runner.v_cache), staging.layer_regions() if staging is not None else [])
        kv.transport, kv.writer = transport, RankKVWriter(transport, rank, staging)
        runner.all_gather_bytes(msgspec.msgpack.encode(info))
        return kv

    def started(self) -> None:
        if self._pool is not None:
            self._pool.unlink()  # every rank has mapped it (or start-up failed)
