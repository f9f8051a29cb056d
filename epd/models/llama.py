"""Llama decoder (Touvron et al. 2023) with paged attention and TP-sharded layers.

Matches transformers' ``LlamaForCausalLM`` numerically in fp32 (RMSNorm in
fp32, rotate-half RoPE, GQA, SwiGLU, optional tied embeddings). Qwen2 and
Qwen3 reuse these blocks with their differences switched on by the config.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from epd.distributed import tp_size
from epd.layers.activation import SiluAndMul
from epd.layers.attention import Attention
from epd.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from epd.layers.layernorm import RMSNorm
from epd.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from epd.layers.rotary import MRotaryEmbedding, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        tp = tp_size()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = total_kv // tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          total_kv, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        mrope = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        # Qwen2-VL / Qwen2.5-VL text models: positions [3, num_tokens] (epd.models.mrope)
        self.rotary_emb = (MRotaryEmbedding(config, self.head_dim, max_positions, list(mrope)) if mrope
                           else RotaryEmbedding(config, self.head_dim, max_positions))
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool = False) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, **attn_flags) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, max_positions, **attn_flags)
        self.mlp = LlamaMLP(config, bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, **attn_flags) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, max_positions, **attn_flags)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """input_ids: [num_tokens] int64, positions: [num_tokens] int64 ->
    hidden [num_tokens, hidden]; ``compute_logits`` -> [n, vocab] fp32 (rank 0)."""

    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions, **self.attention_flags(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_flags(config: PretrainedConfig) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
