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


# Multimodal checkpoints whose LM half (``text_config``) epd runs itself.
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2AudioForConditionalGeneration")
_TEXT_MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                     "qwen3": Qwen3ForCausalLM}


def get_model_class(config: PretrainedConfig):
    """The epd LM class for a checkpoint config (for multimodal checkpoints, the
    class of its ``text_config``).

    Raises:
        ValueError: the architecture is not supported (lists those that are).
    """
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
        if arch in MULTIMODAL_ARCHITECTURES:
            text_type = config.get_text_config().model_type
            if text_type in _TEXT_MODEL_TYPES:
                return _TEXT_MODEL_TYPES[text_type]
    raise ValueError(f"unsupported architecture {archs or None}; epd serves "
                     f"{sorted(MODEL_REGISTRY) + list(MULTIMODAL_ARCHITECTURES)}")
