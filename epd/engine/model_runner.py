"""Executes one engine step on one TP rank: inputs -> forward -> logits.

Rank 0 lives in the engine's process; ranks 1..tp-1 are spawned processes
running ``tp_worker_main``. Each step rank 0 broadcasts the step's
``StepInput`` as msgpack bytes over the gloo/nccl group (no pickle), and
every rank runs the same forward; logits are gathered on rank 0.
Source: nano-vllm ``ModelRunner``, vLLM v1 ``gpu_model_runner.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch
import torch.distributed as dist

from epd.config import EngineConfig
from epd.engine.scheduler import SchedulerOutput
from epd.engine.step_input import StepInput, build_step_input
from epd.kernels.kv_staging import pack_kv, staging_shape, unpack_kv
from epd.layers.attention import AttentionMetadata, PrefillChunk, set_attention_metadata
from epd.models import get_model_class
from epd.models.loader import load_weights

logger = logging.getLogger(__name__)


class KVUnpack(msgspec.Struct, tag="unpack"):
    """Scatter a staged request's KV (written by a prefill instance of ``src_tp``
    ranks) into ``block_ids`` of every rank's paged cache, all layers."""

    staging_block: int
    block_ids: list[int]
    src_tp: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


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
    """What the engine calls on a KV connector (``epd.transfer.kv_connector``; see
    docs/architecture.md, "KV connector"). Source: vLLM v1 ``KVConnectorBase_V1``."""

    def build_step(self, sched: SchedulerOutput) -> StepKV | None:
        """This step's per-layer hook and staging packs (None: no KV to move)."""

    def request_finished(self, seq) -> bool:
        """``seq`` just finished; True keeps its blocks (the connector frees them
        once its KV is sent or the send failed)."""


_CODEC_ENCODER = msgspec.msgpack.Encoder()
_CODEC_DECODER = msgspec.msgpack.Decoder(StepInput | KVUnpack | Shutdown)


class ModelRunner:
    """Holds one TP rank's model shard and KV cache.

    k_cache / v_cache: [num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim], the
    model's dtype; or, quantized (``kv_cache_dtype``), uint8 rows of ``head_dim + scale_bytes(head_dim)`` bytes.
    ``staging``: the instance's staging pool (``epd.transfer.staging``), mapped by
    every rank, or None when the instance moves KV block to block only.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, dist_port: int | None = None,
                 staging=None) -> None:
        self.config = config
        self.rank = rank
        self.staging = staging
        self.device = torch.device(config.device if config.device == "cpu" else f"cuda:{rank}")
        tp = config.tensor_parallel_size
        if tp > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}",
                                    world_size=tp, rank=rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cls = get_model_class(config.hf_config)
        hf = config.text_config
        prev = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = cls(hf, config.max_model_len).eval()
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, config.model)
        self.in_step = False
        self.num_blocks = config.resolve_num_kv_blocks()
        shape = (hf.num_hidden_layers, self.num_blocks, config.block_size, config.num_kv_heads // tp,
                 config.kv_row_elems)
        self.k_cache = torch.zeros(shape, dtype=config.kv_storage_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=config.kv_storage_dtype, device=self.device)
        attn_layers = [m for m in self.model.modules() if m.__class__.__name__ == "Attention"]
        for i, layer in enumerate(attn_layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]
            layer.layer_idx = i
            layer.kv_quant = config.kv_quant
        self.forward = torch.compile(self.model, dynamic=True) if config.compile else self.model
        self.graphs = None
        if config.graph_sizes():
            from epd.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-config.max_model_len // config.block_size)
            self.graphs = DecodeGraphs(self.forward, config.graph_sizes(), max_blocks, self.device, capture=True)
        if self.device.type == "cpu":  # the in-place decode kernel, built once per machine (`make install`)
            from epd.kernels import cpu_attention

            cpu_attention.load()
        if tp > 1:
            dist.barrier()  # every rank mapped the staging file: rank 0 may unlink it

    # ---- rank 0 -------------------------------------------------------
    def execute(self, step: StepInput, mm_embeds: torch.Tensor | None = None,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Run a step on every rank; returns logits [len(logits_indices), vocab]
        (fp32) on rank 0. ``mm_embeds``: [sum of mm_rows lengths, hidden];
        ``layer_hook(l)`` runs (on rank 0) once layer l's K/V is in the cache."""
        # Stays True if the step raises (e.g. Ctrl-C mid-forward): the other ranks
        # are then stuck in a collective and must be killed, not told to shut down.
        self.in_step = True
        if self.config.tensor_parallel_size > 1:
            _broadcast_message(step)
            if step.mm_rows:
                dist.broadcast(mm_embeds.to(self.config.torch_dtype).contiguous(), src=0)
        out = self._run(step, mm_embeds, layer_hook)
        self.in_step = False
        return out

    def unpack_kv(self, staging_block: int, block_ids: list[int], src_tp: int) -> None:
        """Scatter a request's staged KV (every layer) into ``block_ids`` of every
        rank's cache, each rank taking its own head slice; returns when all ranks
        are done. The staging region is laid out by ``src_tp`` prefill ranks
        (``epd.kernels.kv_staging``)."""
        msg = KVUnpack(staging_block, list(block_ids), src_tp)
        self.in_step = True
        if self.config.tensor_parallel_size > 1:
            _broadcast_message(msg)
        self._unpack(msg)
        if self.config.tensor_parallel_size > 1:
            dist.barrier()
        self.in_step = False

    def shutdown(self) -> bool:
        """Tell the other TP ranks to exit. Returns False when they cannot be told
        (a step was interrupted, so they wait in a collective): kill them instead."""
        if self.config.tensor_parallel_size > 1 and dist.is_initialized():
            if self.in_step:
                return False
            _broadcast_message(Shutdown())
            dist.destroy_process_group()
        return True

    # ---- every rank ---------------------------------------------------
    def _staged(self, layer: int, start: int, n: int, src_tp: int) -> torch.Tensor:
        view = self.staging.view(layer, start, n)
        return view.view(staging_shape(src_tp, n, self.config.block_size, self.config.num_kv_heads,
                                       self.config.kv_row_elems))

    def _pack(self, layer: int, packs: list[tuple[int, list[int]]]) -> None:
        tp = self.config.tensor_parallel_size
        for start, ids in packs:
            part = self._staged(layer, start, len(ids), tp)[self.rank]
            pack_kv(self.k_cache[layer], self.v_cache[layer], torch.tensor(ids, device=self.device), part)

    @torch.inference_mode()
    def _unpack(self, msg: KVUnpack) -> None:
        ids = torch.tensor(msg.block_ids, device=self.device)
        heads = self.k_cache.shape[3]
        for layer in range(self.k_cache.shape[0]):
            src = self._staged(layer, msg.staging_block, len(msg.block_ids), msg.src_tp)
            unpack_kv(src, self.k_cache[layer], self.v_cache[layer], ids, self.rank * heads)

    def _layer_hook(self, step: StepInput, user: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """Per-layer work of this rank: pack (every rank), then the rank-0 hook
        (deferred by one layer at TP>1, see ``StepKV``)."""
        packs = step.kv_packs
        if not packs and user is None:
            return None
        deferred = self.config.tensor_parallel_size > 1

        def hook(layer: int) -> None:
            if packs:
                self._pack(layer, packs)
            if user is not None:
                if not deferred:
                    user(layer)
                elif layer > 0:
                    user(layer - 1)

        return hook

    @torch.inference_mode()
    def _run(self, step: StepInput, mm_embeds: torch.Tensor | None = None,
             layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        dev = self.device
        if self.graphs is not None and layer_hook is None and self.graphs.eligible(step):
            return self._logits(step, self.graphs.run(step))
        input_ids = step.tokens().to(dev)
        inputs_embeds = None
        if step.mm_rows:
            inputs_embeds = self.model.embed_input_ids(input_ids)
            mm_embeds = mm_embeds.to(dev, inputs_embeds.dtype)
            src = 0
            for dst, n in step.mm_rows:
                inputs_embeds[dst:dst + n] = mm_embeds[src:src + n]
                src += n
        positions = step.token_positions().to(dev)
        nd = step.num_decode_tokens
        md = AttentionMetadata(
            slot_mapping=step.slots().to(dev),
            num_decode_tokens=nd,
            decode_block_tables=step.block_tables().to(dev) if nd else None,
            decode_context_lens=step.context_lens().to(dev) if nd else None,
            prefills=[PrefillChunk(q0, n, ctx, torch.tensor(bt, dtype=torch.int32, device=dev))
                      for q0, n, ctx, bt in step.prefills],
            layer_hook=self._layer_hook(step, layer_hook),
        )
        with set_attention_metadata(md):
            hidden = self.forward(input_ids, positions, inputs_embeds)
        if layer_hook is not None and self.config.tensor_parallel_size > 1:
            layer_hook(self.k_cache.shape[0] - 1)
        return self._logits(step, hidden)

    def _logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] (on the CPU) of the step's sampled rows."""
        if not step.logits_indices:
            return None
        hidden = hidden[torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.cpu()


def _broadcast_message(msg: StepInput | Shutdown) -> None:
    payload = _CODEC_ENCODER.encode(msg)
    size = torch.tensor([len(payload)], dtype=torch.long)
    dist.broadcast(size, src=0)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)


def _receive_message() -> StepInput | Shutdown:
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return _CODEC_DECODER.decode(buf.numpy().tobytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config_to_json(config: EngineConfig) -> str:
    """The constructor arguments of ``config`` as JSON, for spawning TP ranks."""
    fields = ("model", "tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens",
              "max_prefill_tokens_with_decodes", "max_model_len", "enable_prefix_caching", "num_kv_blocks", "kv_cache_memory_gb",
              "dtype", "kv_cache_dtype", "device", "seed", "compile", "enforce_eager", "cuda_graph_sizes")
    return json.dumps({f: getattr(config, f) for f in fields})


def _die_with_parent() -> None:
    """SIGKILL this process when the process that spawned it dies (Linux PDEATHSIG):
    a TP rank never outlives its instance's rank 0, however rank 0 ends."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # rank 0 died before prctl took effect
        os._exit(1)


def tp_worker_main(config_json: str, rank: int, dist_port: int, threads: int | None = None,
                   staging_args: tuple | None = None) -> None:
    """Entry point of TP rank ``rank`` > 0: serve steps until Shutdown.

    ``staging_args``: ``(num_layers, num_blocks, block_elems, shm_path)`` of rank 0's
    staging pool, mapped here (see ``epd.transfer.staging``)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    if threads:
        torch.set_num_threads(threads)
    config = EngineConfig(**json.loads(config_json))
    staging = None
    if staging_args is not None:
        from epd.transfer.staging import StagingPool

        layers, blocks, elems, path = staging_args
        staging = StagingPool(layers, blocks, elems, config.kv_storage_dtype, shm_path=path, create=False)
    runner = ModelRunner(config, rank, dist_port, staging)
    while True:
        msg = _receive_message()
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, KVUnpack):
            runner._unpack(msg)
            dist.barrier()
            continue
        mm_embeds = None
        if msg.mm_rows:
            rows = sum(n for _, n in msg.mm_rows)
            mm_embeds = torch.empty(rows, config.text_config.hidden_size, dtype=config.torch_dtype)
            dist.broadcast(mm_embeds, src=0)
        runner._run(msg, mm_embeds)
    dist.destroy_process_group()
    os._exit(0)
