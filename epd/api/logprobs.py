"""Logprobs in OpenAI's two shapes: chat (``{"content": [{token, logprob, bytes,
top_logprobs}], "refusal"}``) and completions (``{tokens, token_logprobs,
top_logprobs, text_offset}``). Logprobs come from the raw distribution, as vLLM's."""

from __future__ import annotations

#: decoded token texts a formatter caches at most
_TEXT_CACHE_SIZE = 200_000


def byte_level_alphabet(tokenizer) -> dict[str, int] | None:
    """GPT-2 byte-level BPE's printable stand-in character -> byte, when the
    tokenizer decodes that way (its tokens are then strings of these characters).
    Source: the byte-to-unicode table of OpenAI's GPT-2 ``encoder.py``."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in repr(decoder):
        return None
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class LogprobFormatter:
    """Formats a choice's ``TokenLogprob``\\ s (``token_id``, ``logprob``, ``top_ids``,
    ``top_logprobs``) for one tokenizer; token texts are cached across requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = byte_level_alphabet(tokenizer)
        self._text_cache: dict[int, str] = {}

    def token_text(self, t: int) -> str:
        """Token ``t`` decoded on its own."""
        s = self._text_cache.get(t)
        if s is None:
            s = self.tokenizer.decode([t])
            if len(self._text_cache) < _TEXT_CACHE_SIZE:
                self._text_cache[t] = s
        return s

    def token_bytes(self, t: int) -> list[int]:
        """The token's own UTF-8 bytes (a byte-level BPE token may hold part of a character)."""
        if self.byte_level is not None:
            piece = self.tokenizer.convert_ids_to_tokens(t)
            if isinstance(piece, str) and piece and all(ch in self.byte_level for ch in piece):
                return [self.byte_level[ch] for ch in piece]
        return list(self.token_text(t).encode("utf-8"))

    def chat(self, lps: list) -> dict:
        """Chat completions' ``logprobs`` object."""
        def entry(t: int, lp: float) -> dict:
            return {"token": self.token_text(t), "logprob": lp, "bytes": self.token_bytes(t)}

        return {"content": [{**entry(x.token_id, x.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(x.top_ids, x.top_logprobs)]}
                            for x in lps], "refusal": None}

    def completion(self, lps: list, offset: int) -> dict:
        """Completions' ``logprobs`` object; ``offset``: the text offset of the first token."""
        tokens = [self.token_text(x.token_id) for x in lps]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        tops = []
        for x in lps:  # {text: logprob}; tokens that decode to the same text keep the best one
            top: dict[str, float] = {}
            for t, v in zip(x.top_ids, x.top_logprobs):
                top.setdefault(self.token_text(t), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "top_logprobs": tops,
                "text_offset": offsets}

    def format(self, lps: list, chat: bool, offset: int = 0) -> dict:
        """``chat(lps)`` or ``completion(lps, offset)``."""
        return self.chat(lps) if chat else self.completion(lps, offset)
