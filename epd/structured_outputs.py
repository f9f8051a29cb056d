"""What a constrained request's output must match: one JSON schema, a regex, a choice or a grammar.

One type in-process and on the wire (a msgspec Struct inside ``SamplingParams``): the API
builds it from ``response_format``, vLLM's ``structured_outputs`` extension or a tool
choice; the prefill and decode workers each compile it (``epd.engine.grammar``) and mask
every sampled token with it. Exactly one of the fields is set.

Source: vLLM ``StructuredOutputsParams`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``); OpenAI's ``response_format``.
"""

from __future__ import annotations

import msgspec

#: most bytes a schema, regex or grammar may take (each choice counts towards it)
MAX_SPEC_BYTES = 64 * 1024
#: most strings a ``choice`` may list
MAX_CHOICES = 1024


class StructuredOutputs(msgspec.Struct, frozen=True, omit_defaults=True):
    """The constraint on one request's output.

    Args:
        json: a JSON schema, as JSON text: the output is one JSON value valid against it.
        json_object: the output is one JSON object (any keys and values).
        regex: the whole output matches this regex (Rust ``regex`` syntax, as llguidance reads it).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in llguidance's Lark dialect; GBNF (``root ::= ...``)
            is converted.

    Raises:
        ValueError: none or several fields set, an empty or oversized one (more than
            ``MAX_SPEC_BYTES``); on decode from the wire, ``msgspec.ValidationError``.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {kinds or 'none'}")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must list non-empty strings")
        for k in ("json", "regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not v or len(v.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES):
                raise ValueError(f"{k} must be a non-empty string of at most {MAX_SPEC_BYTES} bytes")
        choice_bytes = 0 if self.choice is None else sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)
        if choice_bytes > MAX_SPEC_BYTES:
            raise ValueError(f"choice takes at most {MAX_SPEC_BYTES} bytes in all")

    @property
    def kind(self) -> str:
        """``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or ``"grammar"``."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """A hashable key of the constraint (the compiled-grammar cache's)."""
        return (self.kind, tuple(self.choice) if self.choice is not None else getattr(self, self.kind))
