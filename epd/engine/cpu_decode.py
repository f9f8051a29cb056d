"""Decode steps on the CPU in one fused C++ call: the CPU's counterpart of CUDA graphs.

A decode step of a small model on a few cores is bound by per-op costs, not arithmetic:
eagerly, each of ~30 layers runs a dozen torch ops, and each op pays Python, the
dispatcher, the allocator and an OpenMP fork. :class:`FusedCPUDecode` hands the whole
step's decoder layers to the extension's ``FusedDecoder`` (``kernels/csrc/decode_layers_cpu.cpp``),
which runs them on the memory-bound linear kernel, the element-wise kernels and the paged
decode attention kernel, rounding where the eager modules round. The embedding lookup and
the LM head stay in Python (``model.embed_input_ids``, ``model.compute_logits``).

It takes decode-only steps of the Llama family (Llama, Mistral, Qwen2, Qwen3; not M-RoPE)
with a full-precision KV cache in fp32 or bf16, at any TP size (``all_reduce`` is called
back after each row-parallel linear) and with a KV connector (``layer_hook`` is called
back once each layer's K/V is stored). Everything else, and every step with
``--enforce-eager``, runs the eager modules, which are the reference
(tests/engine/test_cpu_decode.py). Source: vLLM's CUDA graphs for decode
(``gpu_model_runner.py``), llama.cpp's one-graph-a-step CPU backend (ggml-cpu).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from epd.distributed import all_reduce, tp_size
from epd.layers.rotary import RotaryEmbedding
from epd.models.llama import LlamaForCausalLM


def unsupported_reason(model: nn.Module, config) -> str | None:
    """Why ``model`` under ``config`` (an ``EngineConfig``) cannot decode fused, or None."""
    if config.enforce_eager:
        return "--enforce-eager"
    if config.device != "cpu":
        return f"device {config.device}"
    if config.kv_quant:
        return f"kv-cache-dtype {config.kv_cache_dtype}"
    if config.torch_dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {config.torch_dtype}"
    if not isinstance(model, LlamaForCausalLM):
        return f"model {type(model).__name__}"
    if any(not isinstance(layer.self_attn.rotary_emb, RotaryEmbedding) for layer in model.model.layers):
        return "M-RoPE"
    if any(layer.self_attn.qkv_proj.packed is None for layer in model.model.layers):
        return "weights not packed for the CPU kernel"
    return None


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None]:
    """One decoder layer's tensors in ``FusedDecoder``'s slot order."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    return [layer.input_layernorm.weight, qkv.packed.data, qkv.bias, qkv.weight_scale,
            attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None,
            o.packed.data, o.bias, o.weight_scale, layer.post_attention_layernorm.weight,
            gu.packed.data, gu.bias, gu.weight_scale, down.packed.data, down.bias, down.weight_scale,
            attn.attn.k_cache, attn.attn.v_cache]


class FusedCPUDecode:
    """The fused decode step of one rank's model.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass) whose attention layers already hold
            their KV cache views (``Attention.k_cache`` / ``v_cache``:
            [num_blocks, block_size, num_kv_heads / tp, head_dim]).
        ext: the loaded extension (``epd.kernels.cpu_extension.load()``).
    """

    def __init__(self, model: LlamaForCausalLM, ext) -> None:
        layers = model.model.layers
        attn = layers[0].self_attn
        rope = attn.rotary_emb
        eps = model.model.norm.eps
        self.model = model
        mlp = layers[0].mlp
        out = [attn.qkv_proj.packed.out_features, attn.o_proj.packed.out_features,
               mlp.gate_up_proj.packed.out_features, mlp.down_proj.packed.out_features]
        self.decoder = ext.FusedDecoder([_layer_tensors(layer) for layer in layers], out, model.model.norm.weight,
                                        rope.cos, rope.sin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        float(eps), float(attn.attn.scale))
        self.all_reduce = all_reduce if tp_size() > 1 else None

    @staticmethod
    def eligible(layout, step) -> bool:
        """Whether a step (its ``StepLayout`` and ``StepInput``) is decodes only, without
        media rows or M-RoPE positions."""
        n = layout.num_decode_tokens
        return n > 0 and layout.num_tokens == n and not layout.prefills and not step.mm_rows and \
            not step.mrope_positions

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            layer_hook: Callable[[int], None] | None) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden] in the model's dtype.

        input_ids / positions / slot_mapping: [num_tokens] int64; block_tables:
        [num_tokens, width] int32; context_lens: [num_tokens] int32 (its own token included).

        Raises:
            RuntimeError: a slot, block id or position outside the cache or the RoPE table.
        """
        hidden = self.model.embed_input_ids(input_ids)
        return self.decoder.forward(hidden, positions, slot_mapping, block_tables, context_lens, layer_hook,
                                    self.all_reduce)
