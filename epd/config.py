"""Engine configuration: one dataclass, validated at construction."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the setting and the fix."""


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to run one model instance.

    Args:
        model: resolved model directory (config.json + safetensors + tokenizer).
        tensor_parallel_size: number of TP ranks (processes); must divide the
            attention heads and KV heads.
        block_size: tokens per KV cache block.
        max_num_seqs: most sequences in one running batch.
        max_num_batched_tokens: token budget of one engine step (prefill chunks +
            one token per decode); prompts longer than it are prefilled in chunks.
        max_model_len: longest sequence (prompt + output); default and cap: the
            model's ``max_position_embeddings``.
        enable_prefix_caching: reuse KV of full blocks with equal hash chains.
        num_kv_blocks: KV cache size in blocks; None sizes it from
            ``kv_cache_memory_gb``, capped at what ``max_num_seqs`` sequences of
            ``max_model_len`` tokens can use.
        kv_cache_memory_gb: memory for the KV cache (all layers, K and V), GiB.
        dtype: "auto" (fp32 on CPU, the checkpoint's dtype on CUDA), or a name.
        device: "cpu" or "cuda"; "auto" picks cuda when available.
        seed: seed of the engine-wide generator used by unseeded sampling.

    Raises:
        ConfigError: for an invalid value.
    """

    model: str
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=torch.float32, repr=False)
    _lm_config: PretrainedConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ConfigError(f"model directory {self.model!r} does not exist")
        if self.hf_config is None:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        self._lm_config = _lm_config(self.hf_config)
        cfg = self.text_config
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.dtype == "auto":
            ckpt = getattr(self.hf_config, "dtype", None) or getattr(cfg, "dtype", None)
            self.torch_dtype = torch.float32 if self.device == "cpu" else (
                ckpt if isinstance(ckpt, torch.dtype) else _DTYPES.get(str(ckpt), torch.bfloat16))
        elif self.dtype in _DTYPES:
            self.torch_dtype = _DTYPES[self.dtype]
        else:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        tp = self.tensor_parallel_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % tp or kv_heads % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} must divide the model's {heads} attention heads "
                f"and {kv_heads} KV heads")
        max_pos = cfg.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = max_pos
        elif not 1 <= self.max_model_len <= max_pos:
            raise ConfigError(
                f"max_model_len must be in [1, {max_pos}] (the model's max_position_embeddings), "
                f"got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    @property
    def text_config(self) -> PretrainedConfig:
        """The LM's config (the ``text_config`` of a multimodal checkpoint), whose
        ``tie_word_embeddings`` is what transformers does with the whole checkpoint
        (``epd.models.ties_word_embeddings``): the LM classes and the weight loader
        read the flag from here."""
        return self._lm_config

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V for one block over all layers on one TP rank."""
        cfg = self.text_config
        elem = torch.tensor([], dtype=self.torch_dtype).element_size()
        per_token = 2 * cfg.num_hidden_layers * (self.num_kv_heads // self.tensor_parallel_size) * self.head_dim
        return per_token * self.block_size * elem

    def resolve_num_kv_blocks(self) -> int:
        """KV cache size in blocks: ``num_kv_blocks`` or what ``kv_cache_memory_gb`` holds."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        by_memory = int(self.kv_cache_memory_gb * 2**30) // self.kv_bytes_per_block()
        # More than max_num_seqs full-length sequences can never be resident at once.
        useful = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, useful))


def _lm_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """``hf_config``'s LM config with ``tie_word_embeddings`` resolved for the whole
    checkpoint; a copy when that differs from the text config's own flag (a small
    Qwen2 LM's ``true`` inside Qwen2-Audio, whose class keeps a separate ``lm_head``),
    so ``hf_config`` itself, which the towers and processors also use, is unchanged."""
    from epd.models import ties_word_embeddings

    text = hf_config.get_text_config()
    tied = ties_word_embeddings(hf_config)
    if bool(getattr(text, "tie_word_embeddings", False)) == tied:
        return text
    text = copy.deepcopy(text)
    text.tie_word_embeddings = tied
    return text
