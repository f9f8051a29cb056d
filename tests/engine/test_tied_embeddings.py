"""Tied word embeddings of multimodal checkpoints: epd ties ``lm_head`` exactly when
transformers does, so greedy tokens equal ``generate`` of the whole
``*ForConditionalGeneration`` model.

A small Qwen2 LM has ``tie_word_embeddings: true`` in its config. Inside LLaVA that
ties (``LlavaForConditionalGeneration`` has ``_tied_weights_keys``, LlavaConfig copies
the text config's True up); inside Qwen2-Audio it does not
(``Qwen2AudioForConditionalGeneration`` owns a separate ``lm_head``, saved in the
checkpoint). Reading the flag from the text config alone made epd use the input
embeddings as Qwen2-Audio's output head: wrong from the first token.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open

from epd import LLM, SamplingParams
from epd.config import EngineConfig
from epd.models.registry import MULTIMODAL_ARCHITECTURES, ties_word_embeddings
from epd.models.tiny import create_tiny_model

MAX_TOKENS = 10
PROMPTS = [[5, 6, 7], list(range(10, 40))]
# kind -> (transformers class, does transformers tie lm_head to the embeddings?)
TIED_CASES = {"qwen2-audio": ("Qwen2AudioForConditionalGeneration", False),
              "llava-siglip": ("LlavaForConditionalGeneration", True)}


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    return {k: str(create_tiny_model(k, root / k, tie_word_embeddings=True)) for k in TIED_CASES}


def _hf_greedy(cls_name: str, model_dir: str) -> list[list[int]]:
    model = getattr(transformers, cls_name).from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                               do_sample=False)
            outs.append(o[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("kind", list(TIED_CASES))
def test_tied_text_config_greedy_equals_transformers(kind, tied_dirs):
    cls_name, hf_ties = TIED_CASES[kind]
    model_dir = tied_dirs[kind]
    config = EngineConfig(model_dir, dtype="float32")
    assert config.hf_config.get_text_config().tie_word_embeddings  # the case under test
    expected = _hf_greedy(cls_name, model_dir)
    llm = LLM(model_dir, block_size=8, dtype="float32")
    try:
        got = [list(o.outputs[0].token_ids)
               for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        lm = llm.engine.runner.model
        tied = lm.lm_head.weight is lm.model.embed_tokens.weight
    finally:
        llm.shutdown()
    assert got == expected
    assert tied is hf_ties
    assert config.text_config.tie_word_embeddings is hf_ties


def test_tied_qwen2_audio_checkpoint_keeps_its_own_lm_head(tied_dirs):
    """The precondition of the parity case: the checkpoint's lm_head differs from the
    input embeddings, so using one for the other changes the tokens."""
    path = f"{tied_dirs['qwen2-audio']}/model.safetensors"
    with safe_open(path, framework="pt") as f:
        head, embed = f.get_tensor("language_model.lm_head.weight"), f.get_tensor(
            "language_model.model.embed_tokens.weight")
    assert not torch.equal(head, embed)


@pytest.mark.parametrize("arch", MULTIMODAL_ARCHITECTURES)
def test_tie_table_agrees_with_transformers(arch):
    """``ties_word_embeddings`` mirrors transformers 5: the class ties only through its
    ``_tied_weights_keys``, under the top-level config's flag."""
    keys = getattr(transformers, arch)._tied_weights_keys or {}
    config = transformers.PretrainedConfig(architectures=[arch], tie_word_embeddings=True)
    assert ties_word_embeddings(config) is ("lm_head.weight" in keys)
    config.tie_word_embeddings = False
    assert ties_word_embeddings(config) is False
