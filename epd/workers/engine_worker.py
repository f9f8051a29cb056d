"""Shared parts of the workers that run an LM engine (prefill, decode, aggregated)."""

from __future__ import annotations

import os
import time

import torch

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.messages import (EmbeddingRef, ReleaseEmbeddings, RequestFailed, TensorBlob, TokenLogprob,
                          TokenOutput, encode)
from epd.messages import Heartbeat, KVEvents
from epd.model_files import resolve_model
from epd.roles import Role
from epd.transfer.kv_connector import kv_layout
from epd.workers.base import BaseWorker, WorkerArgs
from epd.workers.embedding_buffer import EmbeddingBuffer


class EngineWorker(BaseWorker):
    """Builds the LLM engine, registers its KV cache (and a receive buffer for
    embeddings) with NIXL, and fetches embeddings from encode workers."""

    def __init__(self, args: WorkerArgs) -> None:
        super().__init__(args)
        path = resolve_model(args.model)
        config = EngineConfig(str(path), tensor_parallel_size=args.tp, **args.engine_kwargs)
        # TP ranks 1.. are spawned by the engine (they die with this process); the staging
        # pool (heterogeneous TP) is shared memory mapped by every rank.
        self.engine = LLMEngine(config, threads=args.threads,
                                kv_staging_blocks=self.staging_blocks(config, args.kv_staging_mb))
        runner = self.engine.runner
        self.staging = self.engine.staging
        self.recv_buffer = EmbeddingBuffer(args.embedding_buffer_mb * 2**20)
        tensors = [runner.k_cache, runner.v_cache, self.recv_buffer.tensor]
        if self.staging is not None:
            tensors.append(self.staging.buffer)  # rank 0's agent registers every rank's staging part
        regions = self.transport.register(tensors)
        self.kv_layout = kv_layout(runner.k_cache, runner.v_cache, config.block_size, args.tp, self.staging,
                                   config.kv_quant)
        self.regions = regions
        # Prefill / aggregated instances report their prefix cache for KV-aware routing.
        if self.role in (Role.PREFILL, Role.PD) and args.rank == 0:
            self.engine.block_manager.enable_kv_events()

    @staticmethod
    def staging_blocks(config: EngineConfig, staging_mb: int) -> int:
        """Staging blocks (one block of K and V of every KV head, all layers) in ``staging_mb`` MiB."""
        if staging_mb <= 0:
            return 0
        elem = torch.tensor([], dtype=config.kv_storage_dtype).element_size()
        per_block = (config.text_config.num_hidden_layers * 2 * config.block_size * config.num_kv_heads
                     * config.kv_row_elems * elem)
        return max(1, staging_mb * 2**20 // per_block)

    def send_kv_events(self) -> None:
        """Send the prefix cache's net changes since the last report as one ``KVEvents``
        (nothing when none); called once per heartbeat."""
        cleared, stored, removed = self.engine.block_manager.drain_kv_events()
        if cleared or stored or removed:
            self.send(KVEvents(self.instance_id, os.getpid(), stored, removed, cleared))

    def load(self) -> Heartbeat:
        dead = self.engine.dead_ranks()
        if dead:  # the instance cannot step without them: exit, so the launcher sees it die
            raise RuntimeError(f"{self.instance_id}: TP rank(s) {dead} died")
        self.send_kv_events()
        self.count_total("kv_transfer_requests", self.transport.num_requests)
        return super().load()

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

    def in_flight(self) -> set[str]:
        return set(self.engine.requests) | set(self.engine.scheduler.waiting_for_remote_kv)

    def stream_step(self) -> list:
        """One engine step; each request's new token goes to the router. Returns the step's outputs."""
        t0 = time.monotonic()
        outs = self.engine.step()
        self.observe("decode_step", time.monotonic() - t0)
        for out in outs:
            comp = out.outputs[0]
            if out.finished and comp.finish_reason == "error":  # media KV gone (decode preemption), or grammar
                # a grammar the engine could not follow further (sampling is masked, so it is the
                # grammar's size, the client's to simplify); or media KV lost, which a retry can redo
                grammar = isinstance(comp.stop_reason, str)
                self.send(RequestFailed(out.request_id, self.instance_id, comp.stop_reason if grammar else
                                        "the request's media KV was evicted here and cannot be recomputed "
                                        "without its embeddings", retryable=not grammar, status=400 if grammar else 503))
                continue
            lps = [TokenLogprob.from_output(comp.logprobs[-1])] if comp.logprobs and comp.token_ids else []
            self.send(TokenOutput(out.request_id, comp.token_ids[-1:], out.finished, comp.finish_reason,
                                  out.num_cached_tokens, lps))
        return outs

    def stats(self) -> dict[str, float]:
        s = self.engine.stats()
        s["kv_transfer_requests"] = self.transport.num_requests
        cfg = self.engine.config
        s["kv_block_bytes"] = cfg.kv_bytes_per_block()  # all layers, K and V, this rank
        s["kv_blocks_per_gb"] = 2**30 // cfg.kv_bytes_per_block()
        if self.staging is not None:
            s["num_staging_blocks"] = self.staging.num_blocks
            s["num_free_staging_blocks"] = self.staging.num_free_blocks
        return s

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            super().close()

