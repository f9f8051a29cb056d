"""Tiny random checkpoints for tests and benchmarks, built offline in well under a second.

``build_tiny_tokenizer()`` trains a ~512-entry byte-level BPE on a fixed corpus (so any
UTF-8 text encodes and round-trips) with SmolLM2-style ChatML special tokens and chat
template.  ``create_tiny_model(kind, out_dir)`` writes a transformers checkpoint
(config.json, model.safetensors, generation_config.json, tokenizer files) of the given
family with hidden size 64 and 2 layers that ``AutoModelForCausalLM.from_pretrained``
and epd's own model code both load.

Weights are random, but not transformers' default init (normal, std 0.02): with that,
every logit of a 64-wide model sits within ~1e-3 of the others, so the greedy argmax is
decided by fp32 rounding noise and two correct implementations (transformers and epd's
paged-attention kernels, batched or not) pick different tokens.  Re-initialising with a
much larger scale (weights std 0.5, norms 1 + noise) spreads the logits over several
units, so top-1/top-2 gaps are orders of magnitude above rounding noise and greedy
outputs can be compared token for token.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from collections.abc import Callable

__all__ = ["TINY_KINDS", "TEXT_KINDS", "MULTIMODAL_KINDS", "TINY_CHAT_TEMPLATE", "build_tiny_tokenizer",
           "create_tiny_model"]

# ChatML as SmolLM2 uses it, minus SmolLM2's default system prompt (keeps prompts short).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Media placeholders (LLaVA's and Qwen2-Audio's own spellings); in every tiny vocab.
IMAGE_TOKEN = "<image>"
AUDIO_TOKEN = "<|AUDIO|>"
# Qwen2-VL / Qwen2.5-VL's vision tokens: added to the "qwen2.5-vl" kind's tokenizer only (after
# the BPE is trained, so every other kind keeps its exact vocabulary).
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's chat template, cut to what the tiny model needs: HF content lists with image
# and video parts as <|vision_start|><|image_pad|><|vision_end|> (one pad, the processor
# expands it), string content as is.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 512

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. What is the capital of France? The capital of France is Paris, a city "
    "on the river Seine known for its museums, cafes and the Eiffel Tower.",
    "Large language models generate text one token at a time. Serving them efficiently means "
    "batching many requests together, keeping the key and value cache in fixed-size pages, "
    "and splitting the work into encode, prefill and decode stages that can run on "
    "different machines.",
    "Once upon a time there was a little robot who lived in a lighthouse by the sea. Every "
    "night it counted the ships: one, two, three, four, five, six, seven, eight, nine, ten. "
    "In the morning it wrote a short report and then it went back to sleep.",
    "Hello! How are you today? I am fine, thank you. Could you please tell me the weather "
    "in London, Tokyo and New York? It is sunny and warm, with a light breeze from the west.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))\n",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2024-01-31 12:30 "
    "[brackets] {braces} (parentheses) <angle> \"quotes\" 'apostrophes' #hash @at $5 50% & *",
    "Unicode text: café, naïve, jalapeño, Zürich, Ελληνικά, русский язык, 日本語のテキスト, "
    "中文文本, 한국어 문장, emoji 🙂🚀🌍, math ∑ ∞ ≤ ≥ → ±.",
)

# Qwen2's pre-tokenizer split (GPT-4-like, single digits).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_MODEL_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Exactly the pipeline transformers' Qwen2Tokenizer rebuilds around the saved
    # vocab/merges: AutoTokenizer ignores tokenizer_config.json's "TokenizersBackend" for
    # model_type "qwen2" (listed in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) and builds
    # Qwen2Tokenizer, which replaces normalizer, pre-tokenizer and decoder.  Using the
    # same pipeline makes every tiny checkpoint tokenize identically however it's loaded.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS) + [IMAGE_TOKEN, AUDIO_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer():
    """A fresh ``PreTrainedTokenizerFast`` (byte-level BPE, ~512 tokens, ChatML template;
    eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos).  Deterministic; the BPE is
    trained once per process (~10 ms) and cached."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=_MODEL_DIMS["max_position_embeddings"],
        chat_template=TINY_CHAT_TEMPLATE,
    )
    return tokenizer


def _base_kwargs(tokenizer) -> dict:
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    return dict(
        _MODEL_DIMS,
        vocab_size=vocab,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )


def _llama_config(tokenizer):
    from transformers import LlamaConfig

    # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
    # head_dim 16 with theta 1e4 gives wavelengths 6..2e4 tokens, so with these llama3
    # settings (high-freq cutoff 256/4 = 64, low-freq cutoff 256/1 = 256) some
    # frequencies stay, one is smoothly interpolated and the rest are divided by 8.
    return LlamaConfig(
        **_base_kwargs(tokenizer),
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )


def _qwen2_config(tokenizer):
    from transformers import Qwen2Config

    # Qwen2 always has q/k/v biases (no attention_bias switch).
    return Qwen2Config(
        **_base_kwargs(tokenizer),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
    )


def _qwen3_config(tokenizer):
    from transformers import Qwen3Config

    # Qwen3: explicit head_dim, RMSNorm on q and k per head, no biases; tied
    # embeddings like the small real Qwen3 checkpoints.
    return Qwen3Config(
        **_base_kwargs(tokenizer),
        head_dim=16,
        attention_bias=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
    )


def _llava_config(tokenizer, vision: str = "clip"):
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    if vision == "clip":
        # 28 px / 7 px patches = 16 patches + CLS; "default" drops CLS -> 16 rows per image.
        vcfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=7, projection_dim=32)
        text, layer, strategy = _llama_config(tokenizer), -2, "default"
    else:
        # SigLIP has no CLS: 32 px / 8 px = 16 rows per image with "full".
        vcfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=8)
        text, layer, strategy = _qwen2_config(tokenizer), -1, "full"
    return LlavaConfig(vision_config=vcfg, text_config=text,
                       image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                       vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                       projector_hidden_act="gelu", image_seq_length=16, tie_word_embeddings=text.tie_word_embeddings)


def _qwen2_audio_config(tokenizer):
    from transformers import Qwen2AudioConfig
    from transformers.models.qwen2_audio import Qwen2AudioEncoderConfig

    acfg = Qwen2AudioEncoderConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                                   num_mel_bins=80, max_source_positions=1500)
    return Qwen2AudioConfig(audio_config=acfg, text_config=_qwen2_config(tokenizer),
                            audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))


def _qwen2_5_vl_config(tokenizer):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig

    # 4 px patches merged 2x2: one LM token per 8x8 pixels; windows of 16 px (2x2 merged
    # tokens) in block 0, full attention in block 1, as the real model alternates them.
    vcfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                  out_hidden_size=_MODEL_DIMS["hidden_size"], patch_size=4, spatial_merge_size=2,
                                  temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                                  tokens_per_second=2)
    # head_dim 16: 8 rotary frequencies split 2 (time) / 3 (height) / 3 (width).
    text = Qwen2_5_VLTextConfig(**_base_kwargs(tokenizer), tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                 "mrope_section": [2, 3, 3]})
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_VL_TOKENS)}
    return Qwen2_5_VLConfig(text_config=text.to_dict(), vision_config=vcfg.to_dict(), tie_word_embeddings=False,
                            **ids)


def _qwen2_vl_config(tokenizer):
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig

    # Qwen2-VL (1.0): full attention in every vision block, a LayerNorm / quick-GELU tower,
    # and video time ids that step by one per temporal patch (no tokens_per_second).
    vcfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=_MODEL_DIMS["hidden_size"], mlp_ratio=2,
                               num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    text = Qwen2VLTextConfig(**_base_kwargs(tokenizer), tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "mrope_section": [2, 3, 3]})
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_VL_TOKENS)}
    return Qwen2VLConfig(text_config=text.to_dict(), vision_config=vcfg.to_dict(), tie_word_embeddings=False, **ids)


#: the tiny Qwen2.5-VL processor's dynamic resolution: images are resized (aspect kept) to
#: between 4 and 64 merged 8x8-pixel tokens
QWEN_VL_MIN_PIXELS = 4 * 8 * 8
QWEN_VL_MAX_PIXELS = 64 * 8 * 8


def _save_processor(kind: str, config, out: pathlib.Path) -> None:
    if kind == "llava":
        from transformers import CLIPImageProcessor

        size = config.vision_config.image_size
        CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)
    elif kind == "llava-siglip":
        from transformers import SiglipImageProcessor

        size = config.vision_config.image_size
        SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(out)
    elif kind in ("qwen2-vl", "qwen2.5-vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vc = config.vision_config
        Qwen2VLImageProcessorPil(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                 temporal_patch_size=vc.temporal_patch_size,
                                 size={"shortest_edge": QWEN_VL_MIN_PIXELS, "longest_edge": QWEN_VL_MAX_PIXELS},
                                 ).save_pretrained(out)
    elif kind == "qwen2-audio":
        from transformers import WhisperFeatureExtractor

        WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, chunk_length=30).save_pretrained(out)


_CONFIGS: dict[str, Callable] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "qwen3": _qwen3_config,
    "llava": _llava_config,
    "llava-siglip": functools.partial(_llava_config, vision="siglip"),
    "qwen2-audio": _qwen2_audio_config,
    "qwen2-vl": _qwen2_vl_config,
    "qwen2.5-vl": _qwen2_5_vl_config,
}
_MULTIMODAL_CLASSES = {"llava": "LlavaForConditionalGeneration", "llava-siglip": "LlavaForConditionalGeneration",
                       "qwen2-audio": "Qwen2AudioForConditionalGeneration",
                       "qwen2-vl": "Qwen2VLForConditionalGeneration",
                       "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration"}
TINY_KINDS = tuple(_CONFIGS)
TEXT_KINDS = ("llama", "qwen2", "qwen3")
MULTIMODAL_KINDS = tuple(_MULTIMODAL_CLASSES)


def _reinit_(model, seed: int) -> None:
    """Large-scale random init so greedy decoding is decisive (see module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "norm" in module:
                p.copy_(1.0 + 0.1 * noise)  # norm gains (incl. qwen3 q_norm/k_norm)
            elif "tower" in name or "projector" in name or "visual" in name:
                # Encoder towers get a milder scale: their features feed the LM, which
                # the 0.5 scale already makes decisive.
                p.copy_(0.1 * noise)
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.5 * noise)


def _set_tied(kind: str, config, tie_word_embeddings: bool) -> None:
    """Set the LM's (text config's) ``tie_word_embeddings``, as a checkpoint whose LM half
    is a tied or untied small LM has it. LlavaConfig also keeps a top-level copy, which
    its ``__post_init__`` raises to the text config's True (mirrored here: the flag is
    set after construction); Qwen2AudioConfig has no top-level flag."""
    config.get_text_config().tie_word_embeddings = tie_word_embeddings
    if kind.startswith("llava"):
        config.tie_word_embeddings = tie_word_embeddings


def create_tiny_model(kind: str, out_dir: str | os.PathLike, seed: int = 0,
                      tie_word_embeddings: bool | None = None,
                      num_hidden_layers: int | None = None) -> pathlib.Path:
    """Write a tiny random ``kind`` checkpoint (``"llama"``, ``"qwen2"`` or ``"qwen3"``)
    with its tokenizer (and image processor / feature extractor for the multimodal kinds
    ``"llava"``, ``"llava-siglip"``, ``"qwen2-audio"``, ``"qwen2-vl"``, ``"qwen2.5-vl"``) to
    ``out_dir``; returns it as a Path. ``"qwen2.5-vl"``: a Qwen2.5-VL (window-attention vision
    tower with patch merger, M-RoPE LM) whose tokenizer adds :data:`QWEN_VL_TOKENS` and a
    Qwen2-VL chat template, with transformers' ``Qwen2VLImageProcessorPil`` (dynamic resolution
    between :data:`QWEN_VL_MIN_PIXELS` and :data:`QWEN_VL_MAX_PIXELS`); ``"qwen2-vl"``: the same
    for Qwen2-VL (1.0: full-attention vision tower, video time ids one per temporal patch).

    ``tie_word_embeddings``: None keeps the family's own setting (tied: llama, qwen3,
    llava; untied: qwen2, llava-siglip, qwen2-audio); True/False sets the LM's (the
    text config's) flag. transformers then decides what the flag does: a tied
    ``qwen2-audio`` still gets its own random ``lm_head`` (its class ties nothing).
    ``num_hidden_layers``: the LM's layer count (None: 2), e.g. more KV bytes per token.
    """
    if kind not in _CONFIGS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(TINY_KINDS)}")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    if kind in ("qwen2-vl", "qwen2.5-vl"):
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
        tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    config = _CONFIGS[kind](tokenizer)
    if tie_word_embeddings is not None:
        _set_tied(kind, config, tie_word_embeddings)
    if num_hidden_layers is not None:
        text = config.get_text_config()
        text.num_hidden_layers = num_hidden_layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = [text.layer_types[0]] * num_hidden_layers
    config.dtype = torch.float32
    torch.manual_seed(seed)
    if kind in _MULTIMODAL_CLASSES:
        import transformers

        model = getattr(transformers, _MULTIMODAL_CLASSES[kind])(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, seed)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _save_processor(kind, config, out)
    return out
