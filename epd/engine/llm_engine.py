"""The engine loop: add requests, ``step()`` = schedule -> run -> sample -> post-process."""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import torch

from epd.config import EngineConfig
from epd.detokenizer import IncrementalDetokenizer
from epd.engine.block_manager import BlockManager
from epd.engine.model_runner import ModelRunner, build_step_input, engine_config_to_json, free_port, tp_worker_main
from epd.engine.scheduler import Scheduler
from epd.errors import InvalidRequestError
from epd.layers.sampler import Sampler
from epd.outputs import CompletionOutput, RequestOutput
from epd.sampling_params import SamplingParams
from epd.sequence import MultiModalPlaceholder, Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer


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


class LLMEngine:
    """One model instance (TP ranks included) with continuous batching.

    ``step()`` returns a ``RequestOutput`` for every request that got a new token
    (or finished) in that step. Not thread-safe: drive it from one thread.
    """

    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._procs: list[mp.Process] = []
        port = None
        tp = config.tensor_parallel_size
        if tp > 1:
            port = free_port()
            threads = max(1, (os.cpu_count() or 1) // tp) if config.device == "cpu" else None
            if threads:
                torch.set_num_threads(threads)
            ctx = mp.get_context("spawn")
            cfg_json = engine_config_to_json(config)
            for rank in range(1, tp):
                p = ctx.Process(target=tp_worker_main, args=(cfg_json, rank, port, threads), daemon=True)
                p.start()
                self._procs.append(p)
        self.runner = ModelRunner(config, 0, port)
        capacity = self.runner.num_blocks * config.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d: max_model_len lowered to %d",
                           capacity, config.max_model_len, capacity)
            config.max_model_len = capacity
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        self.vocab_size = config.text_config.vocab_size
        self.requests: dict[str, _Request] = {}
        self._by_seq_id: dict[int, _Request] = {}
        self._closed = False
        atexit.register(self.shutdown)

    # ---- requests -----------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None,
                    mm_placeholders: list[MultiModalPlaceholder] | None = None,
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
        detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), stop=list(params.stop),
                                       include_stop_str_in_output=params.include_stop_str_in_output,
                                       skip_special_tokens=params.skip_special_tokens)
        req = _Request(seq, prompt, detok)
        self.requests[request_id] = req
        self._by_seq_id[seq.seq_id] = req
        self.scheduler.add(seq)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` if the request can never run."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: pass at least one token", "prompt")
        if n >= self.config.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but this model's max_model_len is {self.config.max_model_len}: "
                f"shorten the prompt to at most {self.config.max_model_len - 1} tokens", "prompt")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; frees its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._by_seq_id.pop(req.seq.seq_id, None)
        self.scheduler.finish(req.seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        step, mm_embeds = build_step_input(sched, self.config.block_size)
        logits = self.runner.execute(step, mm_embeds)
        sampled: dict[int, int] = {}
        if step.seq_ids:
            seqs = [self._by_seq_id[i].seq for i in step.seq_ids]
            sampled = dict(zip(step.seq_ids, self.sampler(logits, seqs)))
        changed = self.scheduler.update(sched, sampled)
        return [self._process(self._by_seq_id[seq.seq_id]) for seq in changed]

    def _process(self, req: _Request) -> RequestOutput:
        seq = req.seq
        params = seq.params
        token = seq.token_ids[-1]
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        stop_str = req.detokenizer.update([token])
        if token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif not params.ignore_eos and token in seq.eos_token_ids:
            self.scheduler.finish(seq, "stop", None)
        elif stop_str is not None:
            self.scheduler.finish(seq, "stop", stop_str)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")
        finished = seq.is_finished
        if finished:
            self.requests.pop(seq.request_id, None)
            self._by_seq_id.pop(seq.seq_id, None)
        return self._output(req, finished)

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        text = req.detokenizer.get_next_output_text(finished, delta=False) if finished else req.detokenizer.output_text
        comp = CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason, seq.stop_reason)
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(seq.request_id, req.prompt, seq.token_ids[:seq.num_prompt_tokens], [comp], finished,
                             max(seq.num_cached_tokens, 0), metrics)

    # ---- introspection --------------------------------------------------
    def stats(self) -> dict[str, float]:
        """KV and queue counters: free/total blocks, running, waiting, preemptions,
        prefix-cache query/hit tokens."""
        bm = self.block_manager
        return {
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.runner.shutdown()
        finally:
            for p in self._procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
