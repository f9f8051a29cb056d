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
from collections.abc import Callable
import os
import socket

import msgspec
import torch
import torch.distributed as dist

from epd.config import EngineConfig
from epd.engine.scheduler import SchedulerOutput
from epd.layers.attention import AttentionMetadata, PrefillChunk, set_attention_metadata
from epd.models import get_model_class
from epd.models.loader import load_weights

logger = logging.getLogger(__name__)


class StepInput(msgspec.Struct, tag="step"):
    """A step's flattened tokens (decodes first), as plain lists.

    input_ids / positions / slot_mapping: [num_tokens]; decode_block_tables:
    [num_decodes][max_blocks] (padded with -1); decode_context_lens: [num_decodes];
    prefills: (q_start, q_len, context_len, block_table) per chunk;
    logits_indices: rows whose logits are returned, in ``seq_ids`` order.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decode_tokens: int
    decode_block_tables: list[list[int]]
    decode_context_lens: list[int]
    prefills: list[tuple[int, int, int, list[int]]]
    logits_indices: list[int]
    seq_ids: list[int]
    # (first step row, rows) spans whose input embeddings come from media
    # embeddings; their rows, concatenated in order, travel beside the message.
    mm_rows: list[tuple[int, int]] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


_CODEC_ENCODER = msgspec.msgpack.Encoder()
_CODEC_DECODER = msgspec.msgpack.Decoder(StepInput | Shutdown)


def build_step_input(out: SchedulerOutput, block_size: int) -> tuple[StepInput, torch.Tensor | None]:
    """Flatten a scheduler output: decode tokens first, then prefill chunks.

    Returns the step and the media embedding rows it needs ([rows, hidden], or
    None for a text-only step), in ``mm_rows`` order.
    """
    # A one-token chunk attends exactly like a decode token.
    decodes = [s for s in out.scheduled if s.num_tokens == 1]
    prefills = [s for s in out.scheduled if s.num_tokens != 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    seq_ids: list[int] = []
    max_blocks = max((len(s.seq.block_table) for s in decodes), default=0)
    tables, ctx_lens, chunks = [], [], []
    mm_rows: list[tuple[int, int]] = []
    mm_parts: list[torch.Tensor] = []
    for k, s in enumerate(decodes + prefills):
        seq, start, n = s.seq, s.start, s.num_tokens
        q_start = len(input_ids)
        input_ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        bt = seq.block_table
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if k < len(decodes):
            tables.append(bt + [-1] * (max_blocks - len(bt)))
            ctx_lens.append(start + 1)
        else:
            chunks.append((q_start, n, start + n, list(bt[: -(-(start + n) // block_size)])))
        for ph, emb in zip(seq.mm_placeholders, seq.mm_embeddings):
            lo, hi = max(start, ph.offset), min(start + n, ph.offset + ph.length)
            if lo < hi:
                mm_rows.append((q_start + lo - start, hi - lo))
                mm_parts.append(emb[lo - ph.offset:hi - ph.offset])
        if s.sample:
            logits_indices.append(len(input_ids) - 1)
            seq_ids.append(seq.seq_id)
    step = StepInput(input_ids, positions, slots, len(decodes), tables, ctx_lens, chunks,
                     logits_indices, seq_ids, mm_rows)
    return step, (torch.cat(mm_parts) if mm_parts else None)


class ModelRunner:
    """Holds one TP rank's model shard and KV cache.

    k_cache / v_cache: [num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim].
    """

    def __init__(self, config: EngineConfig, rank: int = 0, dist_port: int | None = None) -> None:
        self.config = config
        self.rank = rank
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
        shape = (hf.num_hidden_layers, self.num_blocks, config.block_size, config.num_kv_heads // tp, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        attn_layers = [m for m in self.model.modules() if m.__class__.__name__ == "Attention"]
        for i, layer in enumerate(attn_layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]
            layer.layer_idx = i

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

    # ---- every rank ---------------------------------------------------
    @torch.inference_mode()
    def _run(self, step: StepInput, mm_embeds: torch.Tensor | None = None,
             layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        dev = self.device
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=dev)
        inputs_embeds = None
        if step.mm_rows:
            inputs_embeds = self.model.embed_input_ids(input_ids)
            mm_embeds = mm_embeds.to(dev, inputs_embeds.dtype)
            src = 0
            for dst, n in step.mm_rows:
                inputs_embeds[dst:dst + n] = mm_embeds[src:src + n]
                src += n
        positions = torch.tensor(step.positions, dtype=torch.long, device=dev)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            num_decode_tokens=step.num_decode_tokens,
            decode_block_tables=torch.tensor(step.decode_block_tables, dtype=torch.int32, device=dev)
            if step.num_decode_tokens else None,
            decode_context_lens=torch.tensor(step.decode_context_lens, dtype=torch.int32, device=dev)
            if step.num_decode_tokens else None,
            prefills=[PrefillChunk(q0, n, ctx, torch.tensor(bt, dtype=torch.int32, device=dev))
                      for q0, n, ctx, bt in step.prefills],
            layer_hook=layer_hook,
        )
        with set_attention_metadata(md):
            hidden = self.model(input_ids, positions, inputs_embeds)
        if not step.logits_indices:
            return None
        hidden = hidden[torch.tensor(step.logits_indices, dtype=torch.long, device=dev)]
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
              "max_model_len", "enable_prefix_caching", "num_kv_blocks", "kv_cache_memory_gb",
              "dtype", "device", "seed")
    return json.dumps({f: getattr(config, f) for f in fields})


def tp_worker_main(config_json: str, rank: int, dist_port: int, threads: int | None = None) -> None:
    """Entry point of TP rank ``rank`` > 0: serve steps until Shutdown."""
    if threads:
        torch.set_num_threads(threads)
    config = EngineConfig(**json.loads(config_json))
    runner = ModelRunner(config, rank, dist_port)
    while True:
        msg = _receive_message()
        if isinstance(msg, Shutdown):
            break
        mm_embeds = None
        if msg.mm_rows:
            rows = sum(n for _, n in msg.mm_rows)
            mm_embeds = torch.empty(rows, config.text_config.hidden_size, dtype=config.torch_dtype)
            dist.broadcast(mm_embeds, src=0)
        runner._run(msg, mm_embeds)
    dist.destroy_process_group()
    os._exit(0)
