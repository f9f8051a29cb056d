"""Engine configuration: one dataclass, validated at construction."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the setting and the fix."""


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
#: ``kv_cache_dtype`` values: the model's dtype, or a quantized cache (epd.kernels.kv_quant)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
#: weight quantizations (``EngineConfig.quantization``; None: the model's dtype)
QUANTIZATIONS = (None, "int8")


def native_bf16(device: str) -> bool:
    """Whether ``device`` ("cpu" or "cuda") computes bf16 matrix products natively: a
    CUDA GPU that supports bf16 (Ampere and newer), or a CPU with AVX512_BF16 or AMX-BF16
    (read from /proc/cpuinfo; oneDNN then runs bf16 GEMMs at about 2.5x the fp32 rate).
    Without those, a CPU emulates bf16 by converting to fp32, slower than fp32 itself."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def auto_dtype(device: str, checkpoint_dtype=None) -> torch.dtype:
    """``dtype="auto"``: bf16 where ``device`` computes it natively (:func:`native_bf16`),
    except that a CUDA device keeps a checkpoint saved in fp16; otherwise fp32 (as vLLM's
    "auto" casts fp32 checkpoints down to a 16-bit type on GPUs)."""
    ckpt = checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else _DTYPES.get(str(checkpoint_dtype))
    if device == "cuda" and ckpt is torch.float16:
        return torch.float16
    if native_bf16(device):
        return torch.bfloat16
    return torch.float16 if device == "cuda" else torch.float32


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
        max_prefill_tokens_with_decodes: prefill tokens one step may carry while any
            sequence decodes (stall-free batching, Sarathi-Serve; see
            ``epd.engine.scheduler``); 0: no cap below ``max_num_batched_tokens``.
            256 keeps an aggregated CPU worker's steps near 0.3 s with SmolLM2-135M.
        target_step_ms: while any sequence decodes, the prefill tokens of a step are
            also bounded so that its predicted time stays under this many ms (the
            engine's step-time model, ``epd.engine.step_time``; at least one block of
            prompt tokens per step, so prompts always progress); 0: off.
        max_model_len: longest sequence (prompt + output); default and cap: the
            model's ``max_position_embeddings``.
        enable_prefix_caching: reuse KV of full blocks with equal hash chains.
        no_decode_kv_reuse: a decode instance does not look its reservations up in its
            prefix cache: the prefill worker writes every prompt block (the behaviour
            before decode-side reuse; for A/B runs). Without prefix caching, none anyway.
        num_kv_blocks: KV cache size in blocks; None sizes it from
            ``kv_cache_memory_gb``, capped at what ``max_num_seqs`` sequences of
            ``max_model_len`` tokens can use.
        kv_cache_memory_gb: memory for the KV cache (all layers, K and V), GiB.
        kv_host_cache_gb: host memory for the prefix cache's host tier, GiB (0: off;
            ``epd.engine.host_kv_tier``): evicted full blocks are kept there and loaded
            back on a later hit. Needs prefix caching and TP 1.
        kv_disk_cache_dir: directory for the disk tier under the host tier (None: off;
            ``epd.engine.disk_kv_tier``): blocks the host tier evicts are written to one
            anonymous file there, bounded by ``kv_disk_cache_gb``, and read back on a hit.
        kv_disk_cache_gb: size of the disk tier's file, GiB (> 0 with a directory).
        dtype: "auto" (:func:`auto_dtype`: bf16 where the device computes it natively,
            else fp32), or a name ("float32", "bfloat16", "float16"). The KV cache
            follows it unless ``kv_cache_dtype`` quantizes it.
        kv_cache_dtype: "auto" (the model's ``dtype``), or a quantized cache: "int8" or
            "fp8_e4m3" ("fp8" too, as vLLM's ``kv_cache_dtype``): 1-byte values and, per 16
            values of each token and KV head, 4 bytes of scales (int8: a float16 scale and
            min; fp8: a float32 scale; ``epd.kernels.kv_quant``): rows of
            ``head_dim + scale_bytes(head_dim)`` bytes (80 at head_dim 64). int8 with
            ``block_size >= 16`` rewrites each full K block per channel and keeps each
            decode sequence's open block of K exact beside the cache (``kv_channel_k``).
        device: "cpu" or "cuda"; "auto" picks cuda when available.
        compile: run the model through ``torch.compile`` (dynamic shapes; the attention
            layers' paged kernels stay outside the graph).
        quantization: None, or "int8": weight-only int8 of every linear layer and the LM
            head, one fp32 scale per output channel (vLLM's ``--quantization`` flag; W8A16).
            The CPU kernels multiply the int8 weights in place (``epd.kernels.linear``);
            elsewhere they are dequantized per call.
        enforce_eager: run every step on the eager torch modules: no CUDA graphs (used on
            CUDA at TP=1 otherwise) and no fused CPU decode (``epd.engine.cpu_decode``,
            used on the CPU otherwise).
        cuda_graph_sizes: decode batch sizes to capture (``epd.engine.cuda_graphs``);
            None: 1, 2, 4 and multiples of 8 up to ``max_num_seqs``.
        seed: seed of the engine-wide generator used by unseeded sampling.
        speculative_config: vLLM's ``--speculative-config``, a dict or its JSON text, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``
            (``epd.engine.spec_decode``); None: no speculative decoding. Parsed into
            ``speculative`` (a ``SpeculativeConfig``).

    Raises:
        ConfigError: for an invalid value.
    """

    model: str
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int = 256
    target_step_ms: float = 100.0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    no_decode_kv_reuse: bool = False
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    kv_host_cache_gb: float = 0.0
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_gb: float = 0.0
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    seed: int = 0
    compile: bool = False
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    speculative_config: dict | str | None = None
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=torch.float32, repr=False)
    _lm_config: PretrainedConfig | None = field(default=None, init=False, repr=False)
    speculative: object = field(default=None, init=False, repr=False)  # epd.engine.spec_decode.SpeculativeConfig

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
        if isinstance(self.dtype, torch.dtype):  # LLM(dtype=torch.bfloat16), as vLLM takes it
            self.dtype = next((k for k, v in _DTYPES.items() if v == self.dtype and "float" in k), str(self.dtype))
        if self.dtype == "auto":
            self.torch_dtype = auto_dtype(self.device, getattr(self.hf_config, "dtype", None)
                                          or getattr(cfg, "dtype", None))
        elif self.dtype in _DTYPES:
            self.torch_dtype = _DTYPES[self.dtype]
        else:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or 'fp8'), "
                              f"got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)[1:]} (or None), "
                              f"got {self.quantization!r}")
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_prefill_tokens_with_decodes, int) or self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError(f"max_prefill_tokens_with_decodes must be an integer >= 0 (0: off), "
                              f"got {self.max_prefill_tokens_with_decodes!r}")
        if (not isinstance(self.target_step_ms, (int, float)) or isinstance(self.target_step_ms, bool)
                or not self.target_step_ms >= 0 or self.target_step_ms == float("inf")):
            raise ConfigError(f"target_step_ms must be a finite number >= 0 (0: off), got {self.target_step_ms!r}")
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
        if not 0 < self.kv_cache_memory_gb < float("inf"):  # also rejects nan
            raise ConfigError(f"kv_cache_memory_gb must be a finite number > 0, got {self.kv_cache_memory_gb}")
        if not 0 <= self.kv_host_cache_gb < float("inf"):
            raise ConfigError(f"kv_host_cache_gb must be a finite number >= 0 (0: no host tier), "
                              f"got {self.kv_host_cache_gb}")
        if self.kv_host_cache_gb and (self.tensor_parallel_size > 1 or not self.enable_prefix_caching):
            raise ConfigError("kv_host_cache_gb (the prefix cache's host tier) needs prefix caching and tensor "
                              f"parallelism 1 (the tier copies one rank's KV), got TP {self.tensor_parallel_size}"
                              + ("" if self.enable_prefix_caching else " without prefix caching"))
        if not 0 <= self.kv_disk_cache_gb < float("inf"):
            raise ConfigError(f"kv_disk_cache_gb must be a finite number >= 0, got {self.kv_disk_cache_gb}")
        if bool(self.kv_disk_cache_dir) != bool(self.kv_disk_cache_gb):
            raise ConfigError("the disk KV tier needs both kv_disk_cache_dir and kv_disk_cache_gb > 0, got "
                              f"{self.kv_disk_cache_dir!r} and {self.kv_disk_cache_gb}")
        if self.kv_disk_cache_dir and not self.kv_host_cache_gb:
            raise ConfigError("the disk KV tier (kv_disk_cache_dir) sits under the host tier: set kv_host_cache_gb too")
        if self.kv_disk_cache_dir and not os.path.isdir(self.kv_disk_cache_dir):
            raise ConfigError(f"kv_disk_cache_dir {self.kv_disk_cache_dir!r} is not a directory")
        from epd.engine.spec_decode import SpeculativeConfig

        try:
            self.speculative = SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.speculative is not None and self.kv_channel_k:
            raise ConfigError("speculative decoding needs a KV cache without per-channel int8 K (--kv-cache-dtype "
                              "auto or fp8, or --block-size below 16)")

    def graph_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs ([] where none are: on a CPU,
        with ``enforce_eager``, at TP > 1, with a quantized KV cache)."""
        if self.device != "cuda" or self.enforce_eager or self.tensor_parallel_size > 1 or self.kv_quant:
            return []  # (a quantized cache's per-step dequantization has data-dependent shapes)
        from epd.engine.cuda_graphs import capture_sizes

        return capture_sizes(self.max_num_seqs, self.cuda_graph_sizes)

    @property
    def text_config(self) -> PretrainedConfig:
        """The LM's config (the ``text_config`` of a multimodal checkpoint), whose
        ``tie_word_embeddings`` is what transformers does with the whole checkpoint
        (``epd.models.registry.ties_word_embeddings``): the LM classes and the weight loader
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

    @property
    def kv_quant(self) -> str | None:
        """The quantized KV cache's kind ("int8", "fp8_e4m3"), or None (full precision)."""
        return None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def kv_channel_k(self) -> bool:
        """Whether the cache keeps full K blocks per channel, with an exact K residual for
        each decode sequence's partial last block (int8 with ``block_size >= 16``:
        ``epd.kernels.kv_quant.channel_k``)."""
        from epd.kernels.kv_quant import channel_k

        return channel_k(self.kv_quant, self.block_size, self.head_dim)

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: the model's, or uint8 (packed rows) when quantized."""
        return self.torch_dtype if self.kv_quant is None else torch.uint8

    @property
    def kv_row_elems(self) -> int:
        """Elements of one (token, KV head) row of the cache: ``head_dim``, or
        ``head_dim + scale_bytes(head_dim)`` bytes (values and their scales) when quantized."""
        from epd.kernels.kv_quant import scale_bytes

        return self.head_dim + (0 if self.kv_quant is None else scale_bytes(self.head_dim))

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V for one block over all layers on one TP rank."""
        cfg = self.text_config
        elem = torch.tensor([], dtype=self.kv_storage_dtype).element_size()
        per_token = 2 * cfg.num_hidden_layers * (self.num_kv_heads // self.tensor_parallel_size) * self.kv_row_elems
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
    from epd.models.registry import ties_word_embeddings

    text = hf_config.get_text_config()
    tied = ties_word_embeddings(hf_config)
    if bool(getattr(text, "tie_word_embeddings", False)) == tied:
        return text
    text = copy.deepcopy(text)
    text.tie_word_embeddings = tied
    return text
