"""Shared fixtures for the engine tests."""

from __future__ import annotations

import pytest

# A fixed, small corpus with multibyte text (accents, CJK, emoji). Built in-process so
# the tests need no downloaded tokenizer.
_CORPUS = [
    "hello world, hello there. the quick brown fox jumps over the lazy dog.",
    "abc def ghi jkl. STOP is a word; stopping and stops and store.",
    "café naïve résumé élève déjà vu — crème brûlée.",
    "中文 文本 中文测试 你好世界 中国 文字",
    "emoji 😀 😀 🎉 party 👍 ok ❤️ love",
]


def build_byte_bpe_tokenizer(vocab_size: int = 400):
    """Train a tiny byte-level BPE tokenizer (GPT-2 style) and wrap it as a HF fast tokenizer.

    Special tokens: ``<|endoftext|>`` (0, unk), ``<|im_start|>`` (1, bos), ``<|im_end|>`` (2, eos).
    With only ~140 merges, rare characters (e.g. an emoji not in the corpus) are split
    into several byte tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


@pytest.fixture(scope="session")
def byte_bpe_tokenizer():
    """A small in-process byte-level BPE tokenizer (see build_byte_bpe_tokenizer)."""
    return build_byte_bpe_tokenizer()
