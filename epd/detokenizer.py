"""Incremental (streaming) detokenization with stop-string handling.

The design follows vLLM v1's ``vllm/v1/engine/detokenizer.py`` (its
``IncrementalDetokenizer`` / ``detokenize_incrementally``), which in turn took
the prefix_offset / read_offset scheme from Hugging Face text-generation-inference
(TGI, ``decode_token`` in ``server/text_generation_server/models/model.py``).
The code here is written from that description, not copied.

The idea of the scheme: detokenizing one token on its own is wrong for most
tokenizers -- SentencePiece/Metaspace decoders drop the leading space of the first
token, WordPiece joins ``##`` pieces, and byte-level BPE tokens may hold only part
of a UTF-8 character. So each step decodes a short *window* of recent tokens twice:

* ``prefix_text = decode(ids[prefix_offset:read_offset])`` -- tokens whose text has
  already been emitted, kept as context;
* ``new_text = decode(ids[prefix_offset:])`` -- the same plus the newer tokens.

The new text is ``new_text[len(prefix_text):]``. If ``new_text`` ends in U+FFFD the
newest token(s) stop in the middle of a multi-byte character; nothing is emitted
and the offsets stay put until a later token completes the character. Otherwise
the window slides: ``prefix_offset = read_offset``, ``read_offset = len(ids)``. The
window is seeded with the last few prompt tokens, so the first output token is
rendered in context (e.g. its leading space) just as a full decode of
prompt + output renders it. Each step therefore costs O(window), independent of
how long the output already is.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["IncrementalDetokenizer"]

# How many prompt tokens seed the decode window (vLLM and TGI both use 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
# How far back into the prompt we look for those seed tokens (special tokens and
# out-of-vocabulary placeholder ids are passed over), so a prompt ending in a long
# run of such ids still costs O(1) to set up.
_PROMPT_SCAN_LIMIT = 32
# Drop consumed ids from the front of the window list once this many have piled
# up, so memory stays bounded and the trim is amortised O(1) per token.
_TRIM_THRESHOLD = 256

_REPLACEMENT_CHAR = "\ufffd"


class _TokenizerInfo:
    """Per-tokenizer facts that are costly to compute (cached per tokenizer)."""

    __slots__ = ("vocab_len", "skip_ids", "added_tokens")

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_len: int = len(tokenizer)
        added: dict[int, Any] = {}
        try:
            added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        except (NotImplementedError, AttributeError, TypeError):
            added = {}
        skip_ids = set(getattr(tokenizer, "all_special_ids", None) or ())
        skip_ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
        # Ids that decode(..., skip_special_tokens=True) drops (or that the
        # tokenizer calls special); filtered out before they enter the window.
        self.skip_ids: frozenset[int] = frozenset(int(i) for i in skip_ids if i is not None)
        # Added-token id -> literal content, for spaces_between_special_tokens=False.
        self.added_tokens: dict[int, str] = {
            int(i): str(getattr(tok, "content", tok)) for i, tok in added.items()
        }


_INFO_CACHE: weakref.WeakKeyDictionary[Any, _TokenizerInfo] = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    try:
        info = _INFO_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable / not hashable
        return _TokenizerInfo(tokenizer)
    if info is None or info.vocab_len != len(tokenizer):
        info = _TokenizerInfo(tokenizer)
        try:
            _INFO_CACHE[tokenizer] = info
        except TypeError:
            pass
    return info


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Source: vLLM v1's ``vllm/v1/engine/detokenizer.py`` and TGI's incremental
    decoding (prefix_offset / read_offset windows); see the module docstring.

    Behaviour:

    * ``update(ids)`` appends output token ids and decodes only a small window of
      recent tokens per id (O(window) per step, never the whole output).
    * A UTF-8 character is never split: while the tokens end in the middle of a
      multi-byte character (the window decodes to a trailing U+FFFD) nothing is
      emitted for it; it appears once the character is complete. (If generation
      ends before it completes, that partial character is never emitted.)
    * For ordinary text the concatenation of all emitted text equals
      ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)``;
      the first token is decoded in the context of the last prompt tokens, so a
      leading space is rendered as a full decode of prompt + output renders it.
    * ``skip_special_tokens=True`` drops special tokens (``all_special_ids`` and
      added tokens flagged special) before they reach the window.
      ``spaces_between_special_tokens`` matters only when special tokens are kept:
      ``True`` (default) leaves the text exactly as ``tokenizer.decode`` renders
      it; ``False`` renders every added token as its literal content with nothing
      inserted around it, decoding the ordinary tokens between them separately
      (Hugging Face's slow-tokenizer meaning of the flag; for byte-level BPE the
      two give the same text).
    * Stop strings: after each ``update`` only the newly added text plus the
      ``max(len(stop)) - 1`` characters before it is searched, so stop strings
      spanning steps are found. The earliest match wins (ties: the shorter stop
      string); the output text is cut at its start, or kept through its end when
      ``include_stop_str_in_output``. Once a stop string has matched, further
      ``update`` calls are ignored (they return ``None``).
    * ``get_next_output_text`` holds back the last ``max(len(stop)) - 1``
      characters until ``finished`` (or until a stop string has matched), so a stop
      string that is about to be cut away is never sent in part. Unlike vLLM, the
      holdback also applies with ``include_stop_str_in_output=True``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        # Empty stop strings would match everywhere; they are meaningless, drop them.
        self.stop: list[str] = list(dict.fromkeys(s for s in (stop or ()) if s))
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        #: Characters held back by get_next_output_text until finished.
        self.stop_buffer_length = max(self._max_stop_len - 1, 0)
        #: The stop string that ended the output, once one has matched.
        self.matched_stop: str | None = None

        info = _tokenizer_info(tokenizer)
        self._skip_ids: frozenset[int] = info.skip_ids if skip_special_tokens else frozenset()
        # Literal rendering of added tokens is only needed when they are kept and
        # the caller asked for no spaces around them.
        self._added_tokens: dict[int, str] | None = (
            info.added_tokens
            if (not skip_special_tokens and not spaces_between_special_tokens and info.added_tokens)
            else None
        )

        # Seed the window with the last few usable prompt ids (vLLM/TGI style):
        # skip special tokens (when skipping) and ids outside the vocabulary
        # (multimodal placeholders and the like), scanning a bounded distance back.
        seed: list[int] = []
        for tid in reversed(prompt_token_ids[-_PROMPT_SCAN_LIMIT:]):
            tid = int(tid)
            if 0 <= tid < info.vocab_len and tid not in self._skip_ids:
                seed.append(tid)
                if len(seed) == INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:
                    break
        seed.reverse()
        # Window ids: seed prompt ids + output ids that were not skipped.
        self._ids: list[int] = seed
        self._prefix_offset = 0
        self._read_offset = len(seed)
        self._prefix_text: str | None = None  # cached decode of ids[prefix:read]

        self._num_output_tokens = 0
        # Output text as a list of non-empty chunks (joined lazily) so that
        # appending is O(1) and the stop search / delta reads only the tail.
        self._chunks: list[str] = []
        self._len = 0  # total characters in _chunks
        self._sent = 0  # characters already returned by delta calls

    # ------------------------------------------------------------------ public

    @property
    def num_output_tokens(self) -> int:
        """Number of output token ids passed to ``update`` so far."""
        return self._num_output_tokens

    @property
    def output_text(self) -> str:
        """The full decoded output text so far (cut at a matched stop string)."""
        return self._joined()

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append new output token ids; return the stop string that matched
        (output_text is then truncated at it, or kept through it if
        include_stop_str_in_output), else None."""
        if self.matched_stop is not None:
            self._num_output_tokens += len(new_token_ids)
            return None
        len_before = self._len
        for tid in new_token_ids:
            self._num_output_tokens += 1
            tid = int(tid)
            if tid in self._skip_ids:
                continue
            text = self._decode_next(tid)
            if text:
                self._chunks.append(text)
                self._len += len(text)
        if not self.stop or self._len == len_before:
            return None
        return self._check_stop(len_before)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """delta=True: the text not yet returned by earlier delta calls; delta=False:
        the whole text. Unless finished, holds back the last (max stop length - 1)
        characters, which could still become a stop string -- so a stop string is
        never sent in part."""
        if finished:
            self._flush_pending()
        hold = 0 if (finished or self.matched_stop is not None) else self.stop_buffer_length
        end = max(self._len - hold, 0)
        if not delta:
            return self._joined()[:end] if hold else self._joined()
        start = min(self._sent, end)
        if start >= end:
            return ""
        self._sent = end
        return self._tail(self._len - start)[: end - start]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_output_tokens={self._num_output_tokens}, "
            f"chars={self._len}, matched_stop={self.matched_stop!r})"
        )

    # ---------------------------------------------------------------- decoding

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        added = self._added_tokens
        if added is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # spaces_between_special_tokens=False: added tokens verbatim, ordinary
        # runs decoded on their own, nothing inserted between the parts.
        parts: list[str] = []
        run: list[int] = []
        for tid in ids:
            content = added.get(tid)
            if content is None:
                run.append(tid)
                continue
            if run:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            parts.append(content)
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def _decode_next(self, token_id: int) -> str:
        """Add one (non-skipped) id to the window; return the text it completes."""
        ids = self._ids
        ids.append(token_id)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
            self._prefix_text = prefix_text
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet, or the window ends inside a multi-byte character:
            # wait for more tokens (offsets unchanged).
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def _flush_pending(self) -> None:
        """At the end, emit the complete characters still held in the window (the
        last token may carry a whole character plus the start of an unfinished
        one); only the unfinished tail is dropped."""
        if self.matched_stop is not None or self._read_offset >= len(self._ids):
            return
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :]).rstrip(_REPLACEMENT_CHAR)
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if len(new_text) > len(prefix_text) and new_text.startswith(prefix_text):
            text = new_text[len(prefix_text) :]
            len_before = self._len
            self._chunks.append(text)
            self._len += len(text)
            if self.stop:
                self._check_stop(len_before)

    # ------------------------------------------------------------- stop strings

    def _check_stop(self, len_before: int) -> str | None:
        # A match must end in the new text (earlier text was already searched),
        # so it starts at most max_stop_len - 1 characters before it.
        window_len = min(self._len, self._len - len_before + self._max_stop_len - 1)
        window = self._tail(window_len)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            idx = window.find(s)
            if idx != -1 and (best is None or (idx, len(s)) < best[:2]):
                best = (idx, len(s), s)
        if best is None:
            return None
        idx, n, s = best
        cut = self._len - window_len + idx + (n if self.include_stop_str_in_output else 0)
        self._truncate(cut)
        self.matched_stop = s
        return s

    # ------------------------------------------------------------- text chunks

    def _joined(self) -> str:
        chunks = self._chunks
        if not chunks:
            return ""
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0]

    def _tail(self, k: int) -> str:
        """The last ``k`` characters of the output (O(k))."""
        if k <= 0:
            return ""
        parts: list[str] = []
        n = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            n += len(chunk)
            if n >= k:
                break
        text = "".join(reversed(parts))
        return text[-k:] if n > k else text

    def _truncate(self, length: int) -> None:
        excess = self._len - length
        chunks = self._chunks
        while excess > 0:
            last = chunks[-1]
            if len(last) <= excess:
                chunks.pop()
                excess -= len(last)
            else:
                chunks[-1] = last[: len(last) - excess]
                excess = 0
        self._len = length
        self._sent = min(self._sent, length)
