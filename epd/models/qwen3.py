"""Qwen3 (Qwen team 2025): the Llama block with per-head RMSNorm on q and k."""

from __future__ import annotations

from transformers import PretrainedConfig

from epd.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_flags(config: PretrainedConfig) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
