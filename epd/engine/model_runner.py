"""Executes one engine step on one TP rank: inputs -> forward -> logits.

Rank 0 lives in the engine's process; ranks 1..tp-1 are spawned processes
running ``tp_worker_main``. Each step rank 0 broadcasts the step's
``StepInput`` as msgpack bytes over the gloo/nccl group (no pickle): the step's
sequences, input ids and block-table changes, which every rank applies to its own
persistent block table (``epd.engine.block_table``) before laying the step out. Every
rank runs the same forward; logits are gathered on rank 0.
Source: nano-vllm ``ModelRunner``, vLLM v1 ``gpu_model_runner.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist

from epd.config import EngineConfig
from epd.engine.block_table import BlockTables
from epd.engine.kv_connector_base import KVRunnerBase, KVRunnerFactory
from epd.engine.layer_gate import LayerGate
from epd.engine.step_input import StepInput, step_layout
from epd.kernels.kv_quant import channel_fill_plan
from epd.layers.attention import AttentionMetadata, PrefillChunk, set_attention_metadata
from epd.messages import KVRankMessage, Shutdown
from epd.models.loader import load_weights
from epd.models.registry import get_model_class

logger = logging.getLogger(__name__)


_CODEC_ENCODER = msgspec.msgpack.Encoder()
_CODEC_DECODER = msgspec.msgpack.Decoder(StepInput | Shutdown | KVRankMessage)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of TP rank ``rank``: the CPU, or ``cuda:<rank>`` (one GPU per rank)."""
    return torch.device(config.device if config.device == "cpu" else f"cuda:{rank}")


class ModelRunner:
    """Holds one TP rank's model shard and KV cache.

    k_cache / v_cache: [num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim], the
    model's dtype; or, quantized (``kv_cache_dtype``), uint8 rows of ``head_dim + scale_bytes(head_dim)`` bytes.
    ``kv``: the KV connector's side on this rank (``epd.engine.kv_connector_base.KVRunnerBase``,
    set by its factory once the runner exists), or None. At TP>1 every rank calls
    ``barrier()`` once its ``kv`` is set.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, dist_port: int | None = None) -> None:
        self.config = config
        self.rank = rank
        self.kv: KVRunnerBase | None = None
        self.device = rank_device(config, rank)
        self.layer_gate = LayerGate(self.device)  # per-layer KV sends wait for the layer's kernels (GPU)
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
        # This rank's copy of the persistent block table (rows given by rank 0's InputBatch).
        self.tables = BlockTables(config.max_num_seqs, -(-config.max_model_len // config.block_size))
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
            layer.channel_k = config.kv_channel_k
        self._attn_layers = attn_layers
        self.k_resid = torch.empty(0)
        self.forward = torch.compile(self.model, dynamic=True) if config.compile else self.model
        self.graphs = None
        if config.graph_sizes():
            from epd.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-config.max_model_len // config.block_size)
            self.graphs = DecodeGraphs(self.forward, config.graph_sizes(), max_blocks, self.device, capture=True)
        for m in self.model.modules():  # int8 weights (--quantization); the CPU kernel's packing
            if hasattr(m, "process_weights_after_loading"):
                m.process_weights_after_loading(config.quantization)
        self.fused = None
        if self.device.type == "cpu":  # the CPU kernels, built once per machine (`make install`)
            from epd.engine.cpu_decode import FusedCPUDecode, unsupported_reason
            from epd.kernels.cpu_extension import load

            ext = load()
            if ext is not None and unsupported_reason(self.model, config) is None:
                self.fused = FusedCPUDecode(self.model, ext)

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

    def shutdown(self) -> bool:
        """Tell the other TP ranks to exit. Returns False when they cannot be told
        (a step was interrupted, so they wait in a collective): kill them instead."""
        if self.config.tensor_parallel_size > 1 and dist.is_initialized():
            if self.in_step:
                return False
            _broadcast_message(Shutdown())
            dist.destroy_process_group()
        return True

    # ---- the TP group, for the KV runner side (``RankRunner``) --------------
    def broadcast(self, msg) -> None:
        """Rank 0: send ``msg`` (a ``StepInput`` or ``epd.messages.KVRankMessage``) to every other rank."""
        _broadcast_message(msg)

    def gather_states(self, mine: torch.Tensor) -> torch.Tensor:
        """[tp, len(mine)] int64 of every rank's ``mine`` (a collective; rank 0's answer)."""
        return _gather_states(mine, self.config.tensor_parallel_size)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` (a collective over the TP group), in rank order."""
        return _all_gather_bytes(payload, self.config.tensor_parallel_size)

    def barrier(self) -> None:
        """Wait for every TP rank (nothing at TP=1)."""
        if self.config.tensor_parallel_size > 1:
            dist.barrier()

    # ---- every rank ---------------------------------------------------
    def _layer_hook(self, step: StepInput, user: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """Per-layer work of this rank: the KV runner's pack (every rank), then its post
        and the rank-0 hook (deferred by one layer at TP>1, see ``StepKV``)."""
        work = self.kv.layer_work(step) if self.kv is not None else None
        if work is None and user is None:
            return None
        deferred = self.config.tensor_parallel_size > 1
        pack = work.pack if work is not None else None
        post = work.post if work is not None else None
        gate = self.layer_gate

        def send(layer: int) -> None:
            if post is not None:  # e.g. this rank's own writes, as soon as its part is packed
                post(layer)
            if user is not None:
                if not deferred:
                    user(layer)
                elif layer > 0:
                    user(layer - 1)

        def hook(layer: int) -> None:
            if pack is not None:
                pack(layer)
            gate.push(layer, send)  # on a GPU: once the layer's store and pack have run

        return hook

    @torch.inference_mode()
    def _run(self, step: StepInput, mm_embeds: torch.Tensor | None = None,
             layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        dev = self.device
        self.tables.apply(step.table_update)
        lay = step_layout(step, self.tables, self.config.block_size)
        if self.graphs is not None and layer_hook is None and self.graphs.eligible(lay, step):
            return self._logits(step, self.graphs.run(lay))
        input_ids = lay.input_ids.to(dev)
        inputs_embeds = None
        if step.mm_rows:
            inputs_embeds = self.model.embed_input_ids(input_ids)
            mm_embeds = mm_embeds.to(dev, inputs_embeds.dtype)
            src = 0
            for dst, n in step.mm_rows:
                inputs_embeds[dst:dst + n] = mm_embeds[src:src + n]
                src += n
        nd = lay.num_decode_tokens
        fill = None
        if self.config.kv_channel_k:
            if nd and bool((lay.decode_resid_from < self.config.block_size).any()):
                self._reserve_residual(int(lay.decode_rows.max()) + 1)
            fill = channel_fill_plan(lay.slot_mapping, nd, lay.decode_rows, lay.decode_resid_from,
                                     self.config.block_size).to(dev)
        md = AttentionMetadata(
            slot_mapping=lay.slot_mapping.to(dev),
            num_decode_tokens=nd,
            decode_block_tables=lay.decode_block_tables.to(dev) if nd else None,
            decode_context_lens=lay.decode_context_lens.to(dev) if nd else None,
            prefills=[PrefillChunk(q0, n, ctx, bt.to(dev)) for q0, n, ctx, bt in lay.prefills],
            layer_hook=self._layer_hook(step, layer_hook),
            decode_rows=lay.decode_rows.to(dev) if nd else None,
            decode_resid_from=lay.decode_resid_from.to(dev) if nd else None,
            channel_fill=fill,
        )
        try:
            if self.fused is not None and self.fused.eligible(lay, step):
                hidden = self.fused.run(input_ids, lay.positions, md.slot_mapping, md.decode_block_tables,
                                        md.decode_context_lens, md.layer_hook)
            else:
                with set_attention_metadata(md):
                    hidden = self.forward(input_ids, lay.positions.to(dev), inputs_embeds)
            self.layer_gate.flush()
        finally:
            self.layer_gate.discard()  # a failed forward posts none of its remaining sends
            if self.kv is not None:
                self.kv.end_step()
        if layer_hook is not None and self.config.tensor_parallel_size > 1:
            layer_hook(self.k_cache.shape[0] - 1)
        return self._logits(step, hidden)

    def _reserve_residual(self, rows: int) -> None:
        """Grow the int8 cache's K residual (``kv_quant.KResidual``) to at least ``rows``
        persistent-batch rows: [num_layers, rows, block_size, num_kv_heads / tp, head_dim]
        in the model's dtype, a block of exact K a running decode sequence (outside
        ``kv_cache_memory_gb``: a row a running sequence, so about ``max_num_seqs`` rows,
        23.6 MB for SmolLM2 at fp32 and 64 sequences)."""
        have = self.k_resid.shape[1] if self.k_resid.dim() == 5 else 0
        if rows <= have:
            return
        c = self.config
        new = torch.zeros(self.k_cache.shape[0], max(rows, min(2 * have, c.max_num_seqs)), c.block_size,
                          self.k_cache.shape[3], c.head_dim, dtype=c.torch_dtype, device=self.device)
        if have:
            new[:, :have] = self.k_resid
        self.k_resid = new
        for i, layer in enumerate(self._attn_layers):
            layer.k_resid = new[i]

    def _logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] (on the CPU) of the step's sampled rows."""
        if not step.logits_indices:
            return None
        hidden = hidden[torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.cpu()


def _all_gather_bytes(payload: bytes, world: int) -> list[bytes]:
    """Every rank's ``payload`` (a collective over the TP group), in rank order."""
    if world == 1:
        return [payload]
    size = torch.tensor([len(payload)], dtype=torch.long)
    sizes = [torch.empty(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, size)
    n = max(int(s.item()) for s in sizes)
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
    bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [b[:int(s.item())].numpy().tobytes() for b, s in zip(bufs, sizes)]


def _gather_states(mine: torch.Tensor, world: int) -> torch.Tensor:
    """[world, len(mine)] int64 of every rank's ``mine`` (a collective; rank 0's answer)."""
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out)


def _broadcast_message(msg) -> None:
    payload = _CODEC_ENCODER.encode(msg)
    size = torch.tensor([len(payload)], dtype=torch.long)
    dist.broadcast(size, src=0)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)


def _receive_message() -> StepInput | Shutdown | KVRankMessage:
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
              "max_prefill_tokens_with_decodes", "target_step_ms", "max_model_len", "enable_prefix_caching",
              "num_kv_blocks", "kv_cache_memory_gb",
              "dtype", "kv_cache_dtype", "quantization", "device", "seed", "compile", "enforce_eager",
              "cuda_graph_sizes")
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
                   kv: KVRunnerFactory | None = None) -> None:
    """Entry point of TP rank ``rank`` > 0: serve steps until Shutdown.

    ``kv``: the factory of the KV connector's side (``KVRunnerFactory``, prepared on rank 0),
    or None; this rank's side serves the KV messages rank 0 broadcasts."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    if threads:
        torch.set_num_threads(threads)
    config = EngineConfig(**json.loads(config_json))
    runner = ModelRunner(config, rank, dist_port)
    if kv is not None:
        runner.kv = kv.create(runner)
    runner.barrier()  # every rank mapped what rank 0 shares: rank 0 may unlink it
    while True:
        msg = _receive_message()
        if isinstance(msg, Shutdown):
            break
        if not isinstance(msg, StepInput):
            runner.kv.handle(msg)
            continue
        mm_embeds = None
        if msg.mm_rows:
            rows = sum(n for _, n in msg.mm_rows)
            mm_embeds = torch.empty(rows, config.text_config.hidden_size, dtype=config.torch_dtype)
            dist.broadcast(mm_embeds, src=0)
        runner._run(msg, mm_embeds)
    if runner.kv is not None:
        runner.kv.close()
    dist.destroy_process_group()
    os._exit(0)
