"""The engine loop: add requests, ``step()`` = schedule -> run -> sample -> post-process."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import torch

from epd.config import EngineConfig
from epd.detokenizer import IncrementalDetokenizer
from epd.engine.block_manager import BlockManager
from epd.engine.grammar import GrammarCompiler
from epd.engine.input_batch import InputBatch
from epd.engine.kv_connector_base import KVConnectorHooks, KVRunnerFactory
from epd.engine.model_runner import ModelRunner, engine_config_to_json, free_port, rank_device, tp_worker_main
from epd.engine.scheduler import Scheduler
from epd.engine.spec_decode import SpecDecoder, accept
from epd.errors import InvalidRequestError
from epd.layers.sampler import Sampler, skip_draws, token_logprobs
from epd.multimodal import Placeholder
from epd.outputs import CompletionOutput, RequestOutput
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None  # None in workers: the API process detokenizes


def eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from generation_config.json, config.json and the tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _check_kv_args(config: EngineConfig, kv_staging_blocks: int, kv_agents: str, instance_id: str | None,
                   kv_runner: KVRunnerFactory | None) -> None:
    """Raises ConfigError for a KV setup ``LLMEngine`` cannot start (see its docstring)."""
    from epd.config import ConfigError

    if kv_agents not in ("rank0", "per-rank") or (kv_agents == "per-rank" and not instance_id):
        raise ConfigError(f"kv_agents must be 'rank0' or 'per-rank' (with an instance id), got {kv_agents!r}")
    if kv_staging_blocks > 0 and config.device != "cpu" and kv_agents != "per-rank":
        raise ConfigError("staged KV transfers (prefill TP != decode TP) on GPUs need --kv-agents per-rank: "
                          "each TP rank then owns a NIXL agent and a staging buffer in its own VRAM "
                          "(the rank0 mode's pool is host shared memory)")
    if (kv_staging_blocks > 0 or kv_agents == "per-rank") and kv_runner is None:
        raise ConfigError("a KV staging pool or per-rank agents need a KV runner (kv_runner)")


class LLMEngine:
    """One model instance (TP ranks included) with continuous batching.

    ``step()`` returns a ``RequestOutput`` for every request that got a new token
    (or finished) in that step. Not thread-safe: drive it from one thread.
    """

    def __init__(self, config: EngineConfig, tokenizer=None, *, threads: int | None = None,
                 kv_staging_blocks: int = 0, kv_agents: str = "rank0", instance_id: str | None = None,
                 kv_runner: KVRunnerFactory | None = None) -> None:
        """``threads``: torch threads of each TP rank (default on CPU: cores / TP);
        ``kv_runner``: builds the KV connector's side of every TP rank (``runner.kv``;
        ``epd.transfer.kv_runner``), or None. ``kv_staging_blocks``: its staging pool size
        for heterogeneous-TP KV transfers (0: none). ``kv_agents``: "rank0" (one shared-memory
        staging pool; rank 0's NIXL agent moves every rank's part) or "per-rank" (each
        rank a private pool of its own heads and its own NIXL agent, named after
        ``instance_id``). Ranks 1..TP-1 are spawned here and die
        with this process (PDEATHSIG; create the engine in a thread that lives as long
        as the engine, e.g. the main thread).

        Raises:
            ConfigError: staged KV on a non-CPU device; ``kv_agents`` not one of the two,
                or "per-rank" without ``instance_id``; staging or per-rank agents without
                ``kv_runner``.
        """
        self.config = config
        self.tokenizer = tokenizer
        self._procs: list[mp.Process] = []
        _check_kv_args(config, kv_staging_blocks, kv_agents, instance_id, kv_runner)
        staged = 0
        if kv_runner is not None:
            staged = kv_runner.prepare(config, rank_device(config, 0), kv_staging_blocks, kv_agents, instance_id)
        try:
            self.runner = self._start_ranks(config, threads, kv_runner)
        finally:
            if kv_runner is not None:
                kv_runner.started()
        self._fit_max_model_len(staged)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        if config.kv_host_cache_gb:
            from epd.engine.host_kv_tier import HostKVTier

            disk = None
            if config.kv_disk_cache_dir:
                from epd.engine.disk_kv_tier import DiskKVTier

                k = self.runner.k_cache
                num_disk = int(config.kv_disk_cache_gb * 2**30 // config.kv_bytes_per_block())
                disk = DiskKVTier(config.kv_disk_cache_dir, (k.shape[0], *k.shape[2:]), k.dtype, max(1, num_disk))
            num_host = int(config.kv_host_cache_gb * 2**30 // config.kv_bytes_per_block())
            self.block_manager.host_tier = HostKVTier(self.runner.k_cache, self.runner.v_cache, max(1, num_host),
                                                      disk)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_tokens_with_decodes or None,
                                   target_step_ms=config.target_step_ms or None)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len)
        self.sampler = Sampler(config.seed)
        self.spec = SpecDecoder(config.speculative, config.max_model_len) if config.speculative is not None else None
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        self.vocab_size = config.text_config.vocab_size
        # Constrained requests: compiled grammars, and one thread that computes the step's
        # token masks while the forward runs (vLLM and SGLang overlap it the same way).
        self.grammars = GrammarCompiler(config.model, self.vocab_size, self.eos_token_ids, tokenizer)
        self.grammars.warm_up()
        self._mask_thread: concurrent.futures.ThreadPoolExecutor | None = None
        # Grammars not in the cache compile on a thread; their requests wait here (vLLM's
        # WAITING_FOR_FSM), and ``step`` admits them once compiled: request id -> (seq, compile).
        self._compiles: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}
        self._compile_thread: concurrent.futures.ThreadPoolExecutor | None = None
        # The scheduler-side seam of a KV connector (``KVConnectorHooks``), or None.
        self.kv_connector: KVConnectorHooks | None = None
        self.requests: dict[str, _Request] = {}
        self._by_seq_id: dict[int, _Request] = {}
        self._closed = False
        atexit.register(self.shutdown)

    def _start_ranks(self, config: EngineConfig, threads: int | None,
                     kv_runner: KVRunnerFactory | None) -> ModelRunner:
        """Spawn TP ranks 1.. (sharing ``kv_runner``), build rank 0's ``ModelRunner`` and its
        KV side; returns once every rank is ready."""
        port = None
        tp = config.tensor_parallel_size
        if tp > 1:
            port = free_port()
            if threads is None and config.device == "cpu":
                threads = max(1, (os.cpu_count() or 1) // tp)
            if threads:
                torch.set_num_threads(threads)
            ctx = mp.get_context("spawn")
            cfg_json = engine_config_to_json(config)
            for rank in range(1, tp):
                p = ctx.Process(target=tp_worker_main, daemon=True, args=(cfg_json, rank, port, threads, kv_runner))
                p.start()
                self._procs.append(p)
        elif threads:
            torch.set_num_threads(threads)
        runner = ModelRunner(config, 0, port)
        if kv_runner is not None:
            runner.kv = kv_runner.create(runner)
        runner.barrier()  # every rank mapped what rank 0 shares: it may be unlinked
        return runner

    def _fit_max_model_len(self, staged: int) -> None:
        """Lower ``max_model_len`` to what the KV cache holds, and to ``staged`` tokens
        (a prompt's KV must fit the staging pool in one range; 0: no staging)."""
        config = self.config
        capacity = self.runner.num_blocks * config.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d: max_model_len lowered to %d",
                           capacity, config.max_model_len, capacity)
            config.max_model_len = capacity
        if staged and staged < config.max_model_len:
            logger.warning("--kv-staging-mb: the KV staging pool holds %d blocks = %d tokens < max_model_len %d: "
                           "max_model_len lowered to %d (raise --kv-staging-mb for longer prompts)",
                           staged // config.block_size, staged, config.max_model_len, staged)
            config.max_model_len = staged

    # ---- requests -----------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None,
                    mm_placeholders: list[Placeholder] | None = None,
                    mm_embeddings: list[torch.Tensor] | None = None) -> None:
        """Queue a request.

        ``mm_placeholders`` / ``mm_embeddings``: media spans in the prompt and
        their embeddings ([length, hidden] each), merged into the input
        embeddings at prefill.

        Raises:
            InvalidRequestError: empty prompt, prompt of ``max_model_len`` tokens
                or more, token id outside the vocabulary, duplicate request id.
        """
        self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        seq = Sequence(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                       mm_placeholders=mm_placeholders, mm_embeddings=mm_embeddings)
        ready = self._attach_grammar(seq)
        skip_draws(seq, params.num_prior_output_tokens, self.vocab_size)  # a resumed request's earlier draws
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), stop=list(params.stop),
                                           include_stop_str_in_output=params.include_stop_str_in_output,
                                           skip_special_tokens=params.skip_special_tokens)
        req = _Request(seq, prompt, detok)
        self.requests[request_id] = req
        self._by_seq_id[seq.seq_id] = req
        if ready:
            self.scheduler.add(seq)

    def _attach_grammar(self, seq: Sequence) -> bool:
        """Give a constrained sequence its matcher now when its grammar is compiled (True;
        also without a constraint), else start compiling it on a thread (False: ``step``
        attaches it, and queues a local request, once compiled).

        Raises:
            InvalidRequestError: the prior output does not follow a compiled constraint.
        """
        spec = seq.params.structured_outputs
        if spec is None:
            return True
        if self.grammars.is_compiled(spec):
            self._set_grammar(seq, self.grammars.grammar(spec))
            return True
        if self._compile_thread is None:
            self._compile_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epd-grammar-compile")
        self._compiles[seq.request_id] = (seq, self._compile_thread.submit(self.grammars.grammar, spec))
        return False

    def _admit_compiled(self, wait_s: float = 0.0) -> list[RequestOutput]:
        """Attach each compiled grammar of a local request and queue it (waiting up to
        ``wait_s`` for a compile to end); a constraint that does not compile (or that the
        prior output does not follow) ends its request with finish_reason ``"error"``."""
        local = {rid: job for rid, job in self._compiles.items() if rid in self.requests}
        if wait_s and local and not any(f.done() for _, f in local.values()):
            concurrent.futures.wait([f for _, f in local.values()], wait_s, concurrent.futures.FIRST_COMPLETED)
        failed = []
        for rid, (seq, compile_) in local.items():
            if not compile_.done():
                continue
            del self._compiles[rid]
            try:
                self._set_grammar(seq, compile_.result())
            except Exception as e:  # the client's constraint: InvalidRequestError, or the engine's own error
                kind = seq.params.structured_outputs.kind.replace("_", " ")
                msg = str(e) if isinstance(e, InvalidRequestError) else f"the {kind} does not compile: {e}"
                self.scheduler.finish(seq, "error", msg)
                failed.append(self._failed(seq))
                continue
            self.scheduler.add(seq)
        return failed

    @property
    def num_compiling(self) -> int:
        """Local requests whose grammar is compiling (they are not yet queued)."""
        return sum(1 for rid in self._compiles if rid in self.requests)

    def _set_grammar(self, seq: Sequence, grammar) -> None:
        """``seq``'s matcher, advanced past a resumed request's prior output (the last
        ``num_prior_output_tokens`` prompt tokens).

        Raises:
            InvalidRequestError: the prior output does not follow it.
        """
        spec = seq.params.structured_outputs
        n = seq.params.num_prior_output_tokens
        if n and not grammar.accept_all(seq.token_ids[seq.num_prompt_tokens - n:]):
            raise InvalidRequestError(f"the request's earlier output does not follow its {spec.kind} constraint: "
                                      f"{grammar.error}", "structured_outputs")
        seq.grammar = grammar

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` if the request can never run (also: a resumed
        request's ``num_prior_output_tokens`` must leave at least one prompt token)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: pass at least one token", "prompt")
        if n >= self.config.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but this model's max_model_len is {self.config.max_model_len}: "
                f"shorten the prompt to at most {self.config.max_model_len - 1} tokens", "prompt")
        if params.num_prior_output_tokens >= n:
            raise InvalidRequestError(f"num_prior_output_tokens ({params.num_prior_output_tokens}) must be less "
                                      f"than the prompt's {n} tokens", "num_prior_output_tokens")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, running, waiting for remote KV);
        frees its blocks (a KV connector frees the blocks it holds for a send in its
        own ``abort``). Unknown ids are ignored."""
        self._compiles.pop(request_id, None)
        remote = self.scheduler.waiting_for_remote_kv.get(request_id)
        if remote is not None:
            self.scheduler.finish(remote, "abort")
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._by_seq_id.pop(req.seq.seq_id, None)
        self.scheduler.finish(req.seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> sample -> post-process.

        With a KV connector, its ``build_step(scheduler_output)`` gives the step's
        per-layer hook and staging packs (``StepKV``, see ``epd.engine.kv_connector_base``).
        """
        t0 = time.perf_counter()
        failed = self._admit_compiled()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        failed += [self._failed(seq) for seq in sched.failed]
        if not sched.scheduled:
            # nothing to run but compiles: wait for one briefly, not in a busy loop
            return failed + (self._admit_compiled(0.05) if self._compiles else [])
        step, mm_embeds = self.input_batch.build(sched, self.scheduler.running)
        kv = self.kv_connector.build_step(sched) if self.kv_connector is not None else None
        hook = None
        if kv is not None:
            step.kv_packs = kv.kv_packs
            hook = kv.layer_hook
        seqs = [self._by_seq_id[i].seq for i in step.seq_ids]
        rows = [j for j, seq in enumerate(seqs) if seq.grammar is not None]
        masks = None
        if rows:  # the constrained rows' token masks, computed while the forward runs
            if self._mask_thread is None:
                self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epd-grammar")
            masks = self._mask_thread.submit(self.grammars.bitmask, [seqs[j].grammar for j in rows])
        logits = self.runner.execute(step, mm_embeds, hook)
        sampled: dict[int, int | list[int]] = {}
        if seqs:
            tokens = self.sampler(logits, seqs, masks.result() if masks else None, rows)
            sampled = dict(zip(step.seq_ids, tokens))
            for j in rows:
                self._advance_grammar(seqs[j], tokens[j])
            for seq, lp in zip(seqs, token_logprobs(logits, seqs, tokens)):
                if lp is not None:
                    seq.output_logprobs.append(lp)
            for s in sched.scheduled:
                if s.spec:  # (greedy rows: each position's target token)
                    sampled[s.seq.seq_id] = self._verify(s.seq.seq_id, s.spec, step.seq_ids, tokens)
        changed = self.scheduler.update(sched, sampled)
        self.scheduler.observe(sched, (time.perf_counter() - t0) * 1e3)
        num_new = {s.seq.seq_id: len(sampled[s.seq.seq_id]) for s in sched.scheduled if s.spec}
        return failed + [self._process(self._by_seq_id[seq.seq_id], num_new.get(seq.seq_id, 1)) for seq in changed]

    def _verify(self, seq_id: int, drafts: list[int], seq_ids: list[int], tokens: list[int]) -> list[int]:
        """The tokens a sequence emits after verifying ``drafts``: its logits rows are the
        ``1 + len(drafts)`` consecutive ones of ``seq_ids`` naming it (``epd.engine.spec_decode``)."""
        first = seq_ids.index(seq_id)
        emitted = accept(drafts, tokens[first:first + len(drafts) + 1])
        self.spec.record(drafts, emitted)
        return emitted

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> None:
        """Move a constrained sequence's matcher past its new token; a token the grammar
        refuses (it cannot be sampled under the mask) is kept as the matcher's error."""
        if not seq.grammar.accept(token):
            logger.error("request %s: its grammar refused token %d: %s", seq.request_id, token, seq.grammar.error)

    def _failed(self, seq: Sequence) -> RequestOutput:
        """The final output of a sequence the scheduler ended with finish_reason
        ``"error"`` (a decode worker lost its media KV: ``epd.engine.scheduler``)."""
        req = self.requests.pop(seq.request_id)
        self._by_seq_id.pop(seq.seq_id, None)
        return self._output(req, True)

    def _process(self, req: _Request, num_new: int = 1) -> RequestOutput:
        """Check the ``num_new`` tokens ``req`` received this step for a stop, in order; a
        stop among several (speculative decoding) drops the tokens after it."""
        seq = req.seq
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        kept = num_new
        if num_new == 1:
            self._check_stop(req, seq.token_ids[-1])
        else:  # re-append one at a time, so each check sees the output as it was at that token
            new = seq.token_ids[len(seq.token_ids) - num_new:]
            del seq.token_ids[len(seq.token_ids) - num_new:]
            for i, token in enumerate(new):
                seq.token_ids.append(token)
                self._check_stop(req, token)
                if seq.is_finished:
                    kept = i + 1
                    break
        finished = seq.is_finished
        if finished:
            self.requests.pop(seq.request_id, None)
            self._by_seq_id.pop(seq.seq_id, None)
        out = self._output(req, finished)
        out.num_new_tokens = kept
        return out

    def _check_stop(self, req: _Request, token: int) -> None:
        seq, params = req.seq, req.seq.params
        stop_str = req.detokenizer.update([token]) if req.detokenizer is not None else None
        grammar = seq.grammar
        if grammar is not None and grammar.error:
            self._finish(seq, "error", f"the {params.structured_outputs.kind.replace('_', ' ')} exceeded the grammar "
                                       f"engine's limits after {seq.num_output_tokens} output tokens "
                                       f"({grammar.error}); simplify it: fewer nested repetitions, longer lexemes")
        elif token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif not params.ignore_eos and token in seq.eos_token_ids:
            self._finish(seq, "stop", None)
        elif stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif grammar is not None and grammar.is_terminated:
            self._finish(seq, "stop")  # complete: nothing but the end of sequence may follow
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        # A KV connector may keep the blocks of a finished sequence while its KV is
        # sent (vLLM v1's ``request_finished``); it frees them itself.
        keep = self.kv_connector is not None and self.kv_connector.request_finished(seq)
        self.scheduler.finish(seq, reason, stop_reason, free=not keep)

    # ---- decode side of a KV transfer -----------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           mm_placeholders: list[Placeholder] | None = None) -> tuple[list[int], int] | None:
        """Queue a request whose prompt KV another instance will write.

        Its sequence waits in ``WAITING_FOR_REMOTE_KV`` with blocks for the whole
        prompt, headed by the longest prefix this instance's prefix cache holds.
        Returns (the block ids, one per ``block_size`` prompt tokens; how many of
        the first ones already hold the prompt's KV: only the rest need writing), or
        None when there is no room now (nothing changed). ``add_prefilled`` makes it
        run; ``abort_request`` frees it.

        ``mm_placeholders``: the prompt's media spans. The sequence keeps them
        without embeddings (those stay with the prefill side): their item hashes key
        its blocks, and the scheduler never recomputes its media positions (see
        ``epd.engine.scheduler``).

        Raises:
            InvalidRequestError: as ``add_request``; a placeholder outside the prompt.
        """
        self.validate(prompt_token_ids, params)
        if request_id in self.requests or request_id in self.scheduler.waiting_for_remote_kv:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        placeholders = list(mm_placeholders or [])
        if any(p.offset < 0 or p.length < 1 or p.offset + p.length > len(prompt_token_ids) for p in placeholders):
            raise InvalidRequestError("a media placeholder lies outside the prompt", "placeholders")
        seq = Sequence(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids)
        seq.mm_placeholders = placeholders  # no embeddings here: set after the constructor's check
        self._attach_grammar(seq)  # compiling on a thread while the KV arrives; ``add_prefilled`` takes it
        if not self.scheduler.add_remote(seq, reuse=not self.config.no_decode_kv_reuse):
            self._compiles.pop(request_id, None)
            return None
        skip_draws(seq, params.num_prior_output_tokens, self.vocab_size)  # a resumed request's earlier draws
        return list(seq.block_table), seq.num_cached_tokens // self.config.block_size

    def add_prefilled(self, request_id: str, first_token: int) -> RequestOutput:
        """Run a ``WAITING_FOR_REMOTE_KV`` request whose prompt KV now fills its blocks.

        ``first_token`` was sampled by the prefill worker; a seeded random
        request's generator is advanced past that draw so the stream equals
        the aggregated engine's.

        Raises:
            KeyError: no request ``request_id`` waits for remote KV.
        """
        seq = self.scheduler.waiting_for_remote_kv[request_id]
        job = self._compiles.pop(request_id, None)
        if job is not None:  # compiled on a thread since add_remote_request (the prefill worker compiled it too)
            self._set_grammar(seq, job[1].result())
        seq.token_ids.append(first_token)
        if seq.grammar is not None:  # the prefill worker sampled it under the same grammar
            self._advance_grammar(seq, first_token)
        skip_draws(seq, 1, self.vocab_size)
        seq.num_cached_tokens = 0
        self.scheduler.remote_kv_ready(request_id)
        req = _Request(seq, None, None)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                                                     stop=list(seq.params.stop),
                                                     include_stop_str_in_output=seq.params.include_stop_str_in_output,
                                                     skip_special_tokens=seq.params.skip_special_tokens)
        self.requests[request_id] = req
        self._by_seq_id[seq.seq_id] = req
        return self._process(req)

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        detok = req.detokenizer
        text = "" if detok is None else (detok.get_next_output_text(finished, delta=False) if finished
                                         else detok.output_text)
        comp = CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason, seq.stop_reason,
                                seq.output_logprobs if seq.params.logprobs is not None else None)
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(seq.request_id, req.prompt, seq.token_ids[:seq.num_prompt_tokens], [comp], finished,
                             max(seq.num_cached_tokens, 0), metrics)

    # ---- introspection --------------------------------------------------
    def stats(self) -> dict[str, float]:
        """KV and queue counters: free/total blocks, running, waiting, preemptions,
        prefix-cache tokens looked up and found (``prefix_cache_query_tokens``,
        ``prefix_cache_hit_tokens``: tokens, not lookups; ``prefix_cache_host_hit_tokens``:
        of those, tokens loaded back from the host tier; ``prefix_cache_remote_hit_tokens``:
        tokens read from another instance's KV cache), and the host tier's
        ``kv_host_*`` block counts when it is on (``HostKVTier.stats``)."""
        bm = self.block_manager
        return {
            "num_blocks": bm.num_blocks,
            "max_model_len": self.config.max_model_len,
            "num_free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.usage(),
            "num_running": len(self.scheduler.running),
            "num_reserved": len(self.scheduler.waiting_for_remote_kv),
            "num_waiting": len(self.scheduler.waiting),
            "num_queued_prompt_tokens": sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                            for s in (*self.scheduler.waiting, *self.scheduler.running)),
            "num_preemptions": self.scheduler.num_preemptions,
            **(self.spec.stats() if self.spec is not None else {}),
            "prefix_cache_query_tokens": bm.prefix_cache_queries,
            "prefix_cache_hit_tokens": bm.prefix_cache_hits,
            "prefix_cache_host_hit_tokens": bm.prefix_cache_host_hits,
            "prefix_cache_disk_hit_tokens": bm.prefix_cache_disk_hits,
            "prefix_cache_remote_hit_tokens": bm.prefix_cache_remote_hits,
            **(bm.host_tier.stats() if bm.host_tier is not None else {}),
        }

    def dead_ranks(self) -> list[int]:
        """TP ranks (1..TP-1) whose process has exited: the instance cannot step any more."""
        return [i + 1 for i, p in enumerate(self._procs) if not p.is_alive()]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        bm = getattr(self, "block_manager", None)  # (None: the engine failed before it had one)
        if bm is not None and bm.host_tier is not None:
            bm.host_tier.close()  # its disk tier's writer thread and file
        for pool in (self._mask_thread, self._compile_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        atexit.unregister(self.shutdown)  # the exit hook no longer keeps the engine (and its KV cache) alive
        graceful = False
        try:
            graceful = self.runner.shutdown()
        finally:
            for p in self._procs:
                p.join(timeout=10 if graceful else 0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            if not graceful:
                # The other ranks are gone; drop this process's group so that a later
                # engine in the same process does not see a stale TP world.
                import torch.distributed as dist

                if dist.is_initialized():
                    try:
                        dist.destroy_process_group()
                    except RuntimeError:
                        pass
