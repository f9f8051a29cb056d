"""Qwen2 (Yang et al. 2024): the Llama block with biased q/k/v projections."""

from __future__ import annotations

from transformers import PretrainedConfig

from epd.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_flags(config: PretrainedConfig) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
