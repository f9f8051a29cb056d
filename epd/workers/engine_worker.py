"""Shared parts of the workers that run an LM engine (prefill, decode, aggregated)."""

from __future__ import annotations

import os
import time

import torch

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.messages import (
    EmbeddingRef,
    Heartbeat,
    KVEvents,
    RequestFailed,
    TokenLogprob,
    TokenOutput,
)
from epd.models.checkpoints import resolve_model
from epd.multimodal import Placeholder
from epd.roles import Role
from epd.transfer.kv_connector import kv_layout
from epd.transfer.kv_runner import NixlKVRunner, NixlKVRunnerFactory
from epd.transfer.regions import layer_regions
from epd.workers.base import BaseWorker, WorkerArgs
from epd.workers.embedding_buffer import EmbeddingBuffer
from epd.workers.embedding_fetch import EmbeddingFetcher
from epd.workers.engine_metrics import record_engine_stats


class EngineWorker(BaseWorker):
    """Builds the LLM engine, registers its KV cache (and a receive buffer for
    embeddings) with NIXL, and fetches embeddings from encode workers without blocking
    its loop (``fetch_then_admit``; subclasses ``admit``)."""

    def __init__(self, args: WorkerArgs) -> None:
        super().__init__(args)
        path = resolve_model(args.model)
        config = EngineConfig(str(path), tensor_parallel_size=args.tp, **args.engine_kwargs)
        # TP ranks 1.. are spawned by the engine (they die with this process); the staging
        # pool (heterogeneous TP) is shared memory mapped by every rank.
        # With per-rank agents (--kv-agents per-rank) every rank has its own staging pool and
        # NIXL agent instead (epd.transfer.rank_agent).
        self.per_rank = args.kv_agents == "per-rank"
        self.engine = LLMEngine(config, threads=args.threads,
                                kv_staging_blocks=self.staging_blocks(config, args.kv_staging_mb),
                                kv_agents=args.kv_agents, instance_id=self.instance_id,
                                kv_runner=NixlKVRunnerFactory())
        runner = self.engine.runner
        self.kv_runner: NixlKVRunner = runner.kv  # the KV connector's side of rank 0
        self.staging = self.kv_runner.staging
        self.recv_buffer = EmbeddingBuffer(args.embedding_buffer_mb * 2**20, device=runner.device)
        tensors = [runner.k_cache, runner.v_cache, self.recv_buffer.tensor]
        if self.staging is not None:
            tensors.append(self.staging.buffer)  # rank0: every rank's part; per-rank: rank 0's own
        regions = self.transport.register(tensors)
        self.fetcher = EmbeddingFetcher(self.transport, self.recv_buffer, self.peers, args.kv_timeout_s)
        ranks = None
        if self.per_rank:
            from epd.messages import RankKV
            from epd.transfer.rank_agent import RankKVWriter

            self.kv_runner.writer = RankKVWriter(self.transport, 0, self.staging)
            ranks = [RankKV(self.instance_id, b"", layer_regions(runner.k_cache), layer_regions(runner.v_cache),
                            self.staging.layer_regions() if self.staging is not None else []),
                     *self.kv_runner.rank_kv]
        self.kv_layout = kv_layout(runner.k_cache, runner.v_cache, config.block_size, args.tp, self.staging,
                                   config.kv_quant, args.kv_agents, ranks)
        self.regions = regions
        # Prefill / aggregated instances report their prefix cache for KV-aware routing, and
        # decode instances for prefix-aware free-kv routing (when they reuse it).
        if args.rank == 0 and (self.role in (Role.PREFILL, Role.PD)
                               or (self.role == Role.DECODE and not config.no_decode_kv_reuse)):
            self.engine.block_manager.enable_kv_events()

    @staticmethod
    def staging_blocks(config: EngineConfig, staging_mb: int) -> int:
        """Staging blocks (one block of K and V of every KV head, all layers) in ``staging_mb`` MiB.

        Raises:
            ConfigError: ``staging_mb`` > 0 holds no block (`epd launch` refuses it first).
        """
        if staging_mb <= 0:
            return 0
        elem = torch.tensor([], dtype=config.kv_storage_dtype).element_size()
        per_block = (config.text_config.num_hidden_layers * 2 * config.block_size * config.num_kv_heads
                     * config.kv_row_elems * elem)
        if staging_mb * 2**20 < per_block:
            from epd.config import ConfigError

            raise ConfigError(f"--kv-staging-mb {staging_mb} holds no KV staging block: one block is "
                              f"{per_block / 2**20:.2f} MiB; use --kv-staging-mb {-(-per_block // 2**20)} or more")
        return staging_mb * 2**20 // per_block

    def send_kv_events(self) -> None:
        """Send the prefix cache's net changes since the last report as one ``KVEvents``
        (nothing when none); called once per heartbeat."""
        cleared, stored, removed, stored_host, stored_disk = self.engine.block_manager.drain_kv_events()
        if cleared or stored or removed or stored_host or stored_disk:
            self.send(KVEvents(self.instance_id, os.getpid(), stored, removed, cleared, stored_host, stored_disk))

    def load(self) -> Heartbeat:
        dead = self.engine.dead_ranks()
        if dead:  # the instance cannot step without them: exit, so the launcher sees it die
            raise RuntimeError(f"{self.instance_id}: TP rank(s) {dead} died")
        self.send_kv_events()
        self.count_total("kv_transfer_requests", self.kv_requests())
        return super().load()

    def update_metrics(self, stats: dict[str, float]) -> None:
        record_engine_stats(self, stats)
        self.count_total("transfers_unterminated", stats.get("transfers_unterminated", 0)
                         + stats.get("embedding_reads_unterminated", 0))
        if "num_fenced_blocks" in stats:
            self.metrics.kv_fenced_blocks.labels(**self.labels).set(stats["num_fenced_blocks"])
        if "kv_reused_blocks" in stats:  # every rank's share of each block
            self.count_total("kv_transfer_saved_bytes",
                             stats["kv_reused_blocks"] * stats["kv_block_bytes"] * self.args.tp)

    def kv_requests(self) -> int:
        """NIXL requests this instance posted: rank 0's agent, plus its other ranks' (per-rank agents)."""
        return self.transport.num_requests + self.kv_runner.rank_requests

    def peer_added(self, msg) -> None:
        """Per-rank agents: a prefill instance's ranks write to every rank of a decode
        instance, so each of its agents loads the decode instance's rank agents."""
        layout = msg.kv_layout
        if not (self.per_rank and self.role == Role.PREFILL and layout is not None
                and layout.kv_agents == "per-rank" and layout.ranks):
            return
        from epd.messages import RankPeer, RankPeers

        peers = [RankPeer(rk.agent, rk.nixl_metadata or msg.nixl_metadata,
                          [*rk.k_regions, *rk.v_regions, *rk.staging_regions]) for rk in layout.ranks]
        for p in peers[1:]:  # rank 0's agent already holds the instance's own (rank 0) agent
            self.transport.add_peer(p.nixl_metadata, p.regions, p.agent)  # (re)loaded under its name
        self.kv_runner.add_rank_peers(RankPeers(peers))

    def fetch_then_admit(self, msg, encode_instance: str | None, refs: list[EmbeddingRef],
                         placeholders: list[Placeholder]) -> None:
        """Admit ``msg`` (``admit``) now when it has no embeddings, else once ``refs`` were
        read (``epd.workers.embedding_fetch``, polled each loop turn: the loop never waits
        on a read). Raises what ``EmbeddingFetcher.start`` raises (nothing is held then)."""
        if not refs:
            self.admit(msg, [])
            return
        self.fetcher.start(msg.request_id, encode_instance, refs, placeholders, msg)

    def poll(self) -> None:
        """Admit the requests whose embeddings arrived; fail those whose fetch failed."""
        done, failed = self.fetcher.poll()
        for msg, embeddings, seconds in done:
            self.observe("embedding_transfer", seconds)
            try:
                self.admit(msg, embeddings)
            except Exception as e:  # every failure is reported, saying who failed
                failed.append((msg, e))
        for msg, e in failed:
            self.admit_failed(msg, e)

    def admit(self, msg, embeddings: list[torch.Tensor]) -> None:
        """Start ``msg`` on the engine with its items' embeddings (``[rows, hidden]`` each)."""
        raise NotImplementedError

    def admit_failed(self, msg, exc: BaseException) -> None:
        """``msg`` cannot start (its embeddings failed, or the engine refused it)."""
        self.fail(msg.request_id, exc)

    def has_work(self) -> bool:
        return bool(self.engine.scheduler.running or self.engine.scheduler.waiting or self.engine.num_compiling)

    def in_flight(self) -> set[str]:
        return (set(self.engine.requests) | set(self.engine.scheduler.waiting_for_remote_kv)
                | self.fetcher.in_flight())

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
                                        "without its embeddings", retryable=not grammar,
                                        status=400 if grammar else 503))
                continue
            lps = [TokenLogprob.from_output(comp.logprobs[-1])] if comp.logprobs and comp.token_ids else []
            new = comp.token_ids[len(comp.token_ids) - out.num_new_tokens:] if out.num_new_tokens else []
            self.send(TokenOutput(out.request_id, new, out.finished, comp.finish_reason,
                                  out.num_cached_tokens, lps))
        return outs

    def stats(self) -> dict[str, float]:
        s = {**self.engine.stats(), **self.fetcher.stats()}
        s["kv_transfer_requests"] = self.kv_requests()
        cfg = self.engine.config
        s["kv_block_bytes"] = cfg.kv_bytes_per_block()  # all layers, K and V, this rank
        s["kv_blocks_per_gb"] = 2**30 // cfg.kv_bytes_per_block()
        # what the blocks hold: "int8" / "fp8_e4m3" (quantized rows) or the model's dtype ("auto")
        s["kv_cache_dtype"] = (cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto"
                               else str(cfg.torch_dtype).removeprefix("torch."))
        # the linear layers' weights: "int8" (--quantization) or "none" (the model's dtype)
        s["quantization"] = cfg.quantization or "none"
        if self.staging is not None:
            s["num_staging_blocks"] = self.staging.num_blocks
            s["num_free_staging_blocks"] = self.staging.num_free_blocks
        return s

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            super().close()

