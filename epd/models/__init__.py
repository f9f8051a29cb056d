"""LM implementations, keyed by the ``architectures`` entry of a HF config."""

from __future__ import annotations

from transformers import PretrainedConfig

from epd.models.llama import LlamaForCausalLM
from epd.models.qwen2 import Qwen2ForCausalLM
from epd.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(config: PretrainedConfig):
    """The epd class for ``config.architectures[0]``.

    Raises:
        ValueError: the architecture is not supported (lists those that are).
    """
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {getattr(config, 'architectures', None)}; "
                     f"epd serves {sorted(MODEL_REGISTRY)}")
