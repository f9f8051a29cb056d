"""Shared parts of the workers that run an LM engine (prefill, decode, aggregated)."""

from __future__ import annotations

import time

import torch

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.messages import EmbeddingRef, KVLayout, Placeholder, ReleaseEmbeddings, TensorBlob, TokenOutput, encode
from epd.model_files import resolve_model
from epd.sequence import MultiModalPlaceholder
from epd.workers.base import BaseWorker, WorkerArgs
from epd.workers.embedding_buffer import EmbeddingBuffer

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class EngineWorker(BaseWorker):
    """Builds the LLM engine, registers its KV cache (and a receive buffer for
    embeddings) with NIXL, and fetches embeddings from encode workers."""

    def __init__(self, args: WorkerArgs) -> None:
        super().__init__(args)
        path = resolve_model(args.model)
        config = EngineConfig(str(path), tensor_parallel_size=args.tp, **args.engine_kwargs)
        self.engine = LLMEngine(config)
        runner = self.engine.runner
        self.recv_buffer = EmbeddingBuffer(args.embedding_buffer_mb * 2**20)
        regions = self.transport.register([runner.k_cache, runner.v_cache, self.recv_buffer.tensor])
        self.kv_layout = KVLayout(
            num_layers=runner.k_cache.shape[0], num_blocks=runner.num_blocks, block_size=config.block_size,
            num_kv_heads=runner.k_cache.shape[3], head_dim=runner.k_cache.shape[4],
            dtype=_DTYPE_NAMES[config.torch_dtype],
            k_regions=[(runner.k_cache[i].data_ptr(), runner.k_cache[i].nbytes, 0) for i in range(runner.k_cache.shape[0])],
            v_regions=[(runner.v_cache[i].data_ptr(), runner.v_cache[i].nbytes, 0) for i in range(runner.v_cache.shape[0])])
        self.regions = regions
        self.block_bytes = self.kv_layout.block_bytes

    def fetch_embeddings(self, request_id: str, encode_instance: str | None,
                         refs: list[EmbeddingRef]) -> list[torch.Tensor]:
        """Read each referenced embedding from the encode worker over NIXL (one
        read request), then tell it to release them. Returns [rows, hidden] tensors.

        Raises:
            TransferError / TransferTimeout: the read failed or passed its deadline.
            KeyError: unknown encode instance.
        """
        if not refs:
            return []
        peer = self.peers[encode_instance]
        local, offsets = [], []
        try:
            for ref in refs:
                off = self.recv_buffer.alloc(request_id, ref.region[1])
                offsets.append(off)
                local.append((self.recv_buffer.addr + off, ref.region[1], 0))
            xfer = self.transport.read(peer.instance_id, local, [r.region for r in refs],
                                       notif=encode(ReleaseEmbeddings(request_id)))
            t0 = time.monotonic()
            xfer.wait(self.args.kv_timeout_s)
            self.observe("embedding_transfer", time.monotonic() - t0)
            out = []
            for ref, off in zip(refs, offsets):
                raw = bytes(self.recv_buffer.view(off, ref.region[1]).numpy())
                out.append(TensorBlob(ref.dtype, list(ref.shape), raw).to_tensor())
            return out
        finally:
            self.recv_buffer.free(request_id)

    def has_work(self) -> bool:
        return bool(self.engine.scheduler.running or self.engine.scheduler.waiting)

    def stream_step(self) -> None:
        """One engine step; each request's new token goes to the router."""
        t0 = time.monotonic()
        outs = self.engine.step()
        self.observe("decode_step", time.monotonic() - t0)
        for out in outs:
            comp = out.outputs[0]
            self.send(TokenOutput(out.request_id, comp.token_ids[-1:], out.finished, comp.finish_reason,
                                  out.num_cached_tokens))

    @staticmethod
    def placeholders(ph: list[Placeholder]) -> list[MultiModalPlaceholder]:
        return [MultiModalPlaceholder(p.offset, p.length, p.item_hash) for p in ph]

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            super().close()

