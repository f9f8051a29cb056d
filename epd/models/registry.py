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


# Multimodal checkpoints whose LM half (``text_config``) epd runs itself -> whether that
# class ties its ``lm_head`` to the input embeddings when its (top-level) config says so.
# transformers 5 ties only through a class's ``_tied_weights_keys``
# (``PreTrainedModel.get_expanded_tied_weights_keys``): LlavaForConditionalGeneration has
# them (and LlavaConfig raises its flag to the text config's True);
# Qwen2AudioForConditionalGeneration has none and keeps its own ``lm_head`` whatever
# its text config says. tests/engine/test_tied_embeddings.py checks this table.
_MULTIMODAL_TIES = {"LlavaForConditionalGeneration": True, "Qwen2AudioForConditionalGeneration": False,
                    "Qwen2VLForConditionalGeneration": True, "Qwen2_5_VLForConditionalGeneration": True}
MULTIMODAL_ARCHITECTURES = tuple(_MULTIMODAL_TIES)
# (Qwen2-VL's and Qwen2.5-VL's LMs are Qwen2's with M-RoPE, which LlamaAttention picks from ``mrope_section``.)
_TEXT_MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                     "qwen3": Qwen3ForCausalLM, "qwen2_vl_text": Qwen2ForCausalLM, "qwen2_5_vl_text": Qwen2ForCausalLM}


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


def ties_word_embeddings(config: PretrainedConfig) -> bool:
    """Whether the LM's output head is its input embedding matrix for this checkpoint
    config, decided as transformers decides it for the whole model: a text-only
    checkpoint by its ``tie_word_embeddings``; a multimodal one by the class that owns
    ``lm_head`` and the top-level flag, never by its ``text_config`` alone."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in _MULTIMODAL_TIES:
            return _MULTIMODAL_TIES[arch] and bool(getattr(config, "tie_word_embeddings", False))
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
