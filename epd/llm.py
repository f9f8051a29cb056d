"""Offline inference in vLLM's shape: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from transformers import AutoTokenizer

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.errors import InvalidRequestError
from epd.model_files import resolve_model
from epd.outputs import RequestOutput
from epd.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a directory with config.json + safetensors, a .gguf file, or None
            for the embedded default (SmolLM2-135M-Instruct).
        The remaining arguments are ``EngineConfig``'s (see there).

    Raises:
        epd.model_files.ModelNotFoundError / ModelLoadError: the model cannot be
            found or read; epd.config.ConfigError: an invalid setting.
    """

    def __init__(self, model: str | None = None, *, tensor_parallel_size: int = 1, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, num_kv_blocks: int | None = None,
                 kv_cache_memory_gb: float = 2.0, dtype: str = "auto", device: str = "auto", seed: int = 0) -> None:
        path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = EngineConfig(str(path), tensor_parallel_size=tensor_parallel_size, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                              num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
                              dtype=dtype, device=device, seed=seed)
        self.engine = LLMEngine(config, self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Seq) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a dict with 'prompt' / 'prompt_token_ids', "
            f"got {type(prompt).__name__}", "prompt")

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A single token-id list counts as one prompt. Every prompt is validated
        before any runs, so an invalid one raises ``InvalidRequestError`` and
        nothing is queued.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        encoded = [self._to_token_ids(p) for p in prompts]
        for (_, ids), sp in zip(encoded, params_list):
            self.engine.validate(ids, sp)
        order: dict[str, int] = {}
        for i, ((text, ids), sp) in enumerate(zip(encoded, params_list)):
            rid = f"gen-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, ids, sp, prompt=text)
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
        finally:
            for rid, i in order.items():
                if results[i] is None:
                    self.engine.abort_request(rid)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate([{"prompt": p, "prompt_token_ids": i} for p, i in zip(prompts, ids)], sampling_params)

    def shutdown(self) -> None:
        self.engine.shutdown()
