"""PhraseSegmenter: TTS-ready phrases that concatenate exactly to the streamed text."""

from __future__ import annotations

import random

import pytest

from epd.api.realtime.segmenter import PhraseSegmenter

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre, and its cafés, which line "
        "the streets of every arrondissement. Dr. Smith said: \"Hello!\" Then 3.14 is pi.\n\n"
        "1. Red\n2. Blue\nAnd supercalifragilisticexpialidociousandevenlongerwordthatneverends ok "
        + "word " * 40 + "end")


def run(deltas: list[str], **kw) -> list:
    seg = PhraseSegmenter(**kw)
    out = []
    for d in deltas:
        out.extend(seg.feed(d))
    last = seg.flush()
    return out + ([last] if last else [])


def random_deltas(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(20))
def test_segments_concatenate_to_deltas_and_never_split_a_word(seed):
    rng = random.Random(seed)
    deltas = random_deltas(TEXT, rng)
    segs = run(deltas, min_clause_chars=20, max_chars=60)
    assert "".join(s.text for s in segs) == TEXT
    for s, nxt in zip(segs, segs[1:]):
        assert s.text[-1].isspace(), (s.text, nxt.text)  # ends after a whole word
        assert not nxt.text[0].isspace(), (s.text, nxt.text)  # the next one starts with a word
    # Cut the same way whatever the delta boundaries are (one-char deltas vs random).
    assert [s.text for s in segs] == [s.text for s in run(list(TEXT), min_clause_chars=20, max_chars=60)]


def test_cut_points():
    segs = [s.text for s in run(list(TEXT), min_clause_chars=20, max_chars=60)]
    assert segs[0] == "The capital of France is Paris. "  # sentence end
    assert segs[1] == "It is known for the Eiffel Tower, "  # clause past the minimum length
    assert segs[2].startswith("the Louvre, and its cafés, ")  # "the Louvre," alone is under 20 chars
    assert "Dr. Smith said: \"Hello!\" " in segs  # abbreviation kept; closing quote after "!"
    assert "Then 3.14 is pi.\n\n" in segs  # a decimal point is no sentence end
    assert "1. Red\n" in segs and "2. Blue\n" in segs  # list markers are no sentence ends; newlines are
    long = next(s for s in segs if "supercali" in s)
    assert long == "supercalifragilisticexpialidociousandevenlongerwordthatneverends "  # never cut inside
    words = [s for s in segs if s.startswith("word")]
    assert words and all(len(s.strip()) <= 60 for s in words)  # length cut at a word boundary
    assert segs[-1].endswith("end")


def test_reasons_and_flush():
    seg = PhraseSegmenter(min_clause_chars=5, max_chars=100)
    assert seg.feed("Hi") == []
    assert [(s.text, s.reason) for s in seg.feed(" there. Yes")] == [("Hi there. ", "sentence")]
    # "Yes," is under min_clause_chars: no cut there; "Yes, sure," is not, but waits for the next word.
    assert seg.feed(", sure, ") == []
    assert [(s.text, s.reason) for s in seg.feed("go")] == [("Yes, sure, ", "clause")]
    assert seg.flush("cancelled").reason == "cancelled"
    assert seg.flush() is None


def test_nothing_emitted_until_the_next_word_starts():
    seg = PhraseSegmenter()
    assert seg.feed("Paris.") == []
    assert seg.feed(" ") == []  # the whitespace run may go on
    out = seg.feed("It")
    assert [s.text for s in out] == ["Paris. "] and out[0].reason == "sentence"


def test_bad_limits():
    with pytest.raises(ValueError):
        PhraseSegmenter(min_clause_chars=0)
    with pytest.raises(ValueError):
        PhraseSegmenter(min_clause_chars=50, max_chars=10)
