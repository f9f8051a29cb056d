"""Tests for epd.detokenizer.IncrementalDetokenizer (streaming detokenization + stop strings)."""

from __future__ import annotations

import random

import pytest

from epd.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids: list[int], *, chunk: int = 1, finish: bool = True):
    """Feed ids ``chunk`` at a time; return (deltas, stop string or None)."""
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = det.update(ids[i : i + chunk])
        deltas.append(det.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if finish:
        deltas.append(det.get_next_output_text(finished=True, delta=True))
    return deltas, stop


@pytest.fixture
def tok(byte_bpe_tokenizer):
    return byte_bpe_tokenizer


@pytest.fixture
def prompt(tok):
    return [tok.bos_token_id] + enc(tok, "user: hello there") + [tok.eos_token_id]


TEXTS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "  leading spaces\n\nand new lines\ttabs.",
    "café naïve résumé — déjà vu, crème brûlée ß Ω",
    "中文 文本 你好世界 日本語のテキスト 한국어",
    "emoji 😀 🦀 🎉👍🏽 ❤️ 🧑‍🚀 mixed with text 𝔘𝔫𝔦",
]


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_delta_concat_equals_full_decode(tok, prompt, text, chunk):
    ids = enc(tok, text)
    det = IncrementalDetokenizer(tok, prompt)
    deltas, stop = stream(det, ids, chunk=chunk)
    assert stop is None
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert det.output_text == text
    assert det.num_output_tokens == len(ids)
    for d in deltas:
        assert REPLACEMENT not in d


def test_emoji_split_across_byte_tokens_is_held(tok, prompt):
    ids = enc(tok, "🦀")  # not in the training corpus -> several byte tokens
    assert len(ids) >= 2
    assert REPLACEMENT in tok.decode(ids[:1])  # precondition: first token is a partial char
    det = IncrementalDetokenizer(tok, prompt)
    for tid in ids[:-1]:
        det.update([tid])
        assert det.get_next_output_text(finished=False, delta=True) == ""
        assert det.output_text == ""
    det.update(ids[-1:])
    assert det.get_next_output_text(finished=False, delta=True) == "🦀"


def test_random_valid_text_streams(tok, prompt):
    rng = random.Random(1234)
    alphabet = "abcdefghij klmnop.,!?éèüßΩ中文字你好世界😀🦀🎉👍\n"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        ids = enc(tok, text)
        det = IncrementalDetokenizer(tok, prompt)
        deltas, _ = stream(det, ids, chunk=rng.randrange(1, 4))
        assert all(REPLACEMENT not in d for d in deltas)
        assert "".join(deltas) == text


def test_random_id_sequences(tok, prompt):
    """Arbitrary ids (possibly invalid UTF-8): equals the full decode, except that a
    trailing incomplete character is never emitted."""
    rng = random.Random(99)
    specials = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in specials]
    for trial in range(40):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 50))]
        det = IncrementalDetokenizer(tok, prompt)
        out = "".join(stream(det, ids)[0])
        full = tok.decode(ids, skip_special_tokens=True)
        if full.endswith(REPLACEMENT):
            assert full.startswith(out), trial
        else:
            assert out == full, trial


def test_leading_space_after_prompt(tok):
    prompt = enc(tok, "hello")
    ids = enc(tok, " world")
    det = IncrementalDetokenizer(tok, prompt)
    det.update(ids[:1])
    assert det.get_next_output_text(finished=False, delta=True).startswith(" w")
    assert tok.decode(prompt + ids)[len(tok.decode(prompt)) :] == " world"
    det.update(ids[1:])
    assert det.output_text == " world"


def test_empty_prompt_and_empty_update(tok):
    det = IncrementalDetokenizer(tok, [])
    assert det.update([]) is None
    assert det.output_text == "" and det.num_output_tokens == 0
    det.update(enc(tok, "hi"))
    assert det.get_next_output_text(finished=True, delta=True) == "hi"


def test_window_stays_small(tok, prompt):
    """Each step decodes a bounded window, never the whole output."""

    class Spy:
        def __init__(self, inner):
            self.inner = inner
            self.max_len = 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __len__(self):
            return len(self.inner)

        def decode(self, ids, **kw):
            self.max_len = max(self.max_len, len(ids))
            return self.inner.decode(ids, **kw)

    spy = Spy(tok)
    text = "hello world 中文 😀 🦀 café. " * 60
    ids = enc(tok, text)
    assert len(ids) > 500
    det = IncrementalDetokenizer(spy, prompt)
    deltas, _ = stream(det, ids)
    assert "".join(deltas) == text
    assert spy.max_len <= 16


# ---------------------------------------------------------------- special tokens


def test_skip_special_tokens(tok, prompt):
    eos, bos = tok.eos_token_id, tok.bos_token_id
    ids = enc(tok, "hi") + [eos] + enc(tok, " there") + [bos, eos] + enc(tok, " 中文")

    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas, _ = stream(det, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "hi there 中文"
    assert det.num_output_tokens == len(ids)

    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    deltas, _ = stream(det, ids)
    expected = tok.decode(ids, skip_special_tokens=False)
    assert expected == "hi<|im_end|> there<|im_start|><|im_end|> 中文"
    assert "".join(deltas) == expected

    # Byte-level BPE inserts no spaces around special tokens, so the flag changes nothing.
    det = IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    deltas, _ = stream(det, ids)
    assert "".join(deltas) == expected


def test_only_special_tokens_give_no_text(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt)
    det.update([tok.eos_token_id] * 5)
    assert det.output_text == ""
    assert det.get_next_output_text(finished=True, delta=True) == ""
    assert det.num_output_tokens == 5


# ---------------------------------------------------------------- stop strings


def test_stop_string_in_one_token(tok, prompt):
    ids = enc(tok, "hello world and more")
    assert tok.decode(ids[1:2]) == " world"  # precondition: " world" is a single token
    det = IncrementalDetokenizer(tok, prompt, stop=[" world"])
    assert det.update(ids[:1]) is None
    assert det.update(ids[1:2]) == " world"
    assert det.output_text == "hello"
    assert det.matched_stop == " world"


def test_stop_string_spanning_tokens(tok, prompt):
    ids = enc(tok, "hello world and more")
    det = IncrementalDetokenizer(tok, prompt, stop=["o wor"])
    deltas, stop = stream(det, ids)
    assert stop == "o wor"
    assert det.output_text == "hell"
    assert "".join(deltas) == "hell"
    assert det.num_output_tokens == 2  # stopped on " world", nothing after fed


def test_stop_string_spanning_updates_char_by_char(tok, prompt):
    pieces = ["x", "y", "S", "T", "O", "P", "z"]
    det = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    sent = ""
    stop = None
    for p in pieces:
        stop = det.update(enc(tok, p))
        sent += det.get_next_output_text(finished=stop is not None, delta=True)
        if stop:
            break
    assert stop == "STOP"
    assert sent == det.output_text == "xy"


def test_stop_string_at_very_start(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=["hello"])
    deltas, stop = stream(det, enc(tok, "hello world"))
    assert stop == "hello"
    assert det.output_text == ""
    assert "".join(deltas) == ""


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(tok, prompt, include):
    ids = enc(tok, "abc def ghi jkl")
    det = IncrementalDetokenizer(tok, prompt, stop=["ghi"], include_stop_str_in_output=include)
    deltas, stop = stream(det, ids)
    assert stop == "ghi"
    expected = "abc def ghi" if include else "abc def "
    assert det.output_text == expected
    assert "".join(deltas) == expected
    assert det.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("include", [False, True])
def test_multiple_stop_strings_earliest_wins(tok, prompt, include):
    ids = enc(tok, "abc def ghi jkl")
    # All in one update, so both stop strings are in the same search window.
    det = IncrementalDetokenizer(
        tok, prompt, stop=["jkl", "ghi", "def"], include_stop_str_in_output=include
    )
    assert det.update(ids) == "def"
    assert det.output_text == ("abc def" if include else "abc ")

    # Same start: the shorter (first to complete) wins.
    det = IncrementalDetokenizer(tok, prompt, stop=["def g", "de"], include_stop_str_in_output=True)
    assert det.update(ids) == "de"
    assert det.output_text == "abc de"


def test_stop_cut_inside_a_token_and_update_after_stop_ignored(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=["lo w"])
    assert det.update(enc(tok, "hello world")) == "lo w"
    assert det.output_text == "hel"
    assert det.update(enc(tok, " more")) is None
    assert det.output_text == "hel"


# ---------------------------------------------------------------- holdback


def test_holdback_until_known_not_stop(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    assert det.update(enc(tok, "abc STO")) is None
    first = det.get_next_output_text(finished=False, delta=True)
    assert first == "abc "  # "STO" (3 = len("STOP") - 1 chars) is held back
    assert det.get_next_output_text(finished=False, delta=False) == "abc "
    assert det.output_text == "abc STO"

    assert det.update(enc(tok, "RE")) is None  # "STORE": not a stop string after all
    second = det.get_next_output_text(finished=False, delta=True)
    assert second == "ST"
    assert det.get_next_output_text(finished=False, delta=True) == ""  # nothing new
    rest = det.get_next_output_text(finished=True, delta=True)
    assert rest == "ORE"
    assert first + second + rest == "abc STORE"
    assert det.get_next_output_text(finished=True, delta=False) == "abc STORE"


def test_holdback_then_stop_never_leaks_partial_stop(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    sent = ""
    for piece in ["abc ", "S", "TO", "P tail"]:
        stop = det.update(enc(tok, piece))
        sent += det.get_next_output_text(finished=stop is not None, delta=True)
        assert "S" not in sent
    assert stop == "STOP"
    assert sent == det.output_text == "abc "


def test_finished_flushes_everything(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=["a much longer stop string"])
    det.update(enc(tok, "short"))
    assert det.get_next_output_text(finished=False, delta=True) == ""
    assert det.get_next_output_text(finished=False, delta=False) == ""
    assert det.get_next_output_text(finished=True, delta=True) == "short"
    assert det.get_next_output_text(finished=True, delta=True) == ""
    assert det.get_next_output_text(finished=True, delta=False) == "short"


def test_no_stop_means_no_holdback(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt)
    det.update(enc(tok, "abc STO"))
    assert det.get_next_output_text(finished=False, delta=True) == "abc STO"


def test_finish_flushes_a_complete_char_before_an_unfinished_one():
    """The last token may hold a whole character plus the first byte of the next:
    at the end the whole character is emitted, only the unfinished tail dropped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from epd.detokenizer import IncrementalDetokenizer

    # A byte-level vocab where one token is "з" (2 bytes) followed by the first byte of "ж".
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    z, zh = "з".encode(), "ж".encode()
    bl = {b: ch for b, ch in zip(range(256), _bytes_to_unicode())}
    combo = "".join(bl[b] for b in z + zh[:1])
    vocab[combo] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    a = vocab[bl[ord("a")]]
    detok = IncrementalDetokenizer(hf, [a])
    detok.update([a, vocab[combo]])
    assert detok.get_next_output_text(finished=False, delta=True) == "a"
    assert detok.get_next_output_text(finished=True, delta=True) == "з"
    assert detok.output_text == "aз"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable-unicode map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]
