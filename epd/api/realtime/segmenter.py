"""Cut streamed text into TTS-ready phrases (the realtime API's ``response.output_text.segment``).

A text-to-speech engine wants its first phrase as early as possible and never half a
word. :class:`PhraseSegmenter` takes the text deltas of one response as they stream
and returns phrases cut at

* sentence ends: a word ending in ``.``, ``!``, ``?`` or ``…`` (closing quotes and
  brackets may follow) and then whitespace; list markers (``1.``), single-letter
  initials (``J.``) and a few abbreviations (``Mr.``, ``e.g.`` ...) are not sentence
  ends; a line break is one;
* clause marks: a word ending in ``,``, ``;``, ``:`` or a dash, then whitespace, once
  the phrase has at least ``min_clause_chars`` characters;
* length: a phrase past ``max_chars`` without such a mark is cut at its last word
  boundary within ``max_chars`` (or the first one after it, for a word longer than
  that: a word is never split).

Each phrase keeps the whitespace that follows its last word, so a phrase is emitted
once the first character of the next word has arrived, every phrase but the last
ends in whitespace and starts with a non-space, and the phrases concatenate to
exactly the text fed in. Whitespace-separated scripts only: text without spaces is
cut only at the end.

Same idea as the sentence chunkers in front of streaming TTS (e.g. Pipecat's and
LiveKit Agents' tokenizers); written here from the rules above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SENTENCE_ENDS = ".!?…"
CLAUSE_ENDS = ",;:—–"
CLOSERS = "\"')]}»”’"
ABBREVIATIONS = frozenset({"mr.", "mrs.", "ms.", "dr.", "prof.", "st.", "vs.", "e.g.", "i.e.", "jr.", "sr."})
_WHITESPACE = re.compile(r"\s+")


@dataclass(slots=True, frozen=True)
class Segment:
    """One phrase. ``reason``: ``sentence``, ``clause``, ``length``, ``end`` (the
    response finished) or ``cancelled`` (the rest of a cancelled response)."""

    text: str
    reason: str


class PhraseSegmenter:
    """Incremental phrase cutter for one response.

    Args:
        min_clause_chars: a clause mark cuts only once the phrase is at least this
            many characters long (leading/trailing whitespace not counted).
        max_chars: a phrase longer than this is cut at a word boundary.

    Raises:
        ValueError: ``min_clause_chars < 1`` or ``max_chars < min_clause_chars``.
    """

    def __init__(self, min_clause_chars: int = 20, max_chars: int = 120) -> None:
        if min_clause_chars < 1 or max_chars < min_clause_chars:
            raise ValueError(f"need 1 <= min_clause_chars <= max_chars, got {min_clause_chars}, {max_chars}")
        self.min_clause_chars = min_clause_chars
        self.max_chars = max_chars
        self.buffer = ""

    def feed(self, text: str) -> list[Segment]:
        """Add a delta; return the phrases it completed (possibly none)."""
        self.buffer += text
        out = []
        while (seg := self._cut()) is not None:
            out.append(seg)
        return out

    def flush(self, reason: str = "end") -> Segment | None:
        """The text still held (the response ended), or None when nothing is held."""
        if not self.buffer:
            return None
        seg, self.buffer = Segment(self.buffer, reason), ""
        return seg

    def _cut(self) -> Segment | None:
        buf = self.buffer
        # Whitespace runs that start after a word and are followed by the next word's
        # first character: the only places a phrase may end.
        runs = [m for m in _WHITESPACE.finditer(buf) if m.start() > 0 and m.end() < len(buf)]
        word_start = 0
        for m in runs:
            word = buf[word_start:m.start()].strip()
            word_start = m.end()
            reason = self._boundary(word, buf[:m.start()], "\n" in m.group())
            if reason is not None:
                return self._emit(m.end(), reason)
        if len(buf.strip()) > self.max_chars and runs:
            within = [m for m in runs if m.start() <= self.max_chars]
            return self._emit((within[-1] if within else runs[0]).end(), "length")
        return None

    def _boundary(self, word: str, phrase: str, newline: bool) -> str | None:
        if not phrase.strip():
            return None
        if newline:
            return "sentence"
        bare = word.rstrip(CLOSERS)
        if bare and bare[-1] in SENTENCE_ENDS and not self._not_a_sentence_end(bare):
            return "sentence"
        if bare and bare[-1] in CLAUSE_ENDS and len(phrase.strip()) >= self.min_clause_chars:
            return "clause"
        return None

    @staticmethod
    def _not_a_sentence_end(word: str) -> bool:
        if not word.endswith("."):
            return False
        stem = word[:-1]
        return (word.lower() in ABBREVIATIONS or stem.isdigit()
                or (len(stem) == 1 and stem.isalpha() and stem.isupper()))

    def _emit(self, end: int, reason: str) -> Segment:
        seg, self.buffer = Segment(self.buffer[:end], reason), self.buffer[end:]
        return seg
