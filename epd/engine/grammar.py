"""Constrained decoding: a request's ``StructuredOutputs`` as a grammar, and its token masks.

The grammar engine is llguidance (Microsoft's, the engine behind vLLM's ``guidance``
backend and SGLang's ``llguidance`` backend), kept behind this module's three names:
``GrammarCompiler`` (text -> compiled grammar, cached by constraint) and ``Grammar`` (one
request's matcher); the sampler applies the masks (``epd.layers.sampler.apply_bitmask``).
It was picked by measuring here (SmolLM2
tokenizer, a nested schema, one matcher; ``benchmarks/structured_outputs.py``): llguidance
compiles a schema in ~1 ms and masks a token in ~0.2 ms; xgrammar 0.2.9 compiles in ~24 ms
and masks in ~0.01 ms. Both masks hide under a 30+ ms CPU forward (the mask is computed
while the forward runs); compile time lands on every new schema's TTFT, and llguidance
installs as one abi3 wheel with no dependencies.

Unbounded runs are limited so that a weak model cannot loop to ``max_tokens`` inside
valid JSON: JSON has no free whitespace (compact ``,`` / ``:`` separators), and a JSON
string the schema leaves unbounded (no ``maxLength``, ``enum`` or ``const``; a ``pattern``
is unanchored, so it does not bound) takes at most ``MAX_STRING_CHARS`` characters; ``json_object`` is a
grammar of JSON objects with such strings and bounded numbers.

Source: llguidance (github.com/guidance-ai/llguidance, ``LLMatcher``); vLLM v1
``structured_output`` (bitmask per step, applied to the logits before sampling).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import numpy as np

from epd.errors import InvalidRequestError
from epd.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

#: most characters of a JSON string the schema leaves unbounded
MAX_STRING_CHARS = 1024
#: compiled grammars kept per process
CACHE_SIZE = 256

# Any JSON object, compact, with bounded strings and numbers (``json_object``).
JSON_OBJECT_LARK = r"""
start: object
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (pair ("," pair)*)? "}"
pair: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"(\\(["\\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1F\x7F]){0,%d}"/
NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?/
""" % MAX_STRING_CHARS

_BOUNDED_STRING_KEYS = ("maxLength", "enum", "const")  # a JSON schema pattern is unanchored: unbounded


def bounded_schema(schema):
    """``schema`` (a JSON schema, dict) with every unbounded string given ``maxLength``
    ``MAX_STRING_CHARS`` (a copy; the output stays valid against the original)."""
    if isinstance(schema, list):
        return [bounded_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_schema(v) for k, v in schema.items()}
    t = out.get("type")
    if (t == "string" or (isinstance(t, list) and "string" in t)) and not any(k in out for k in _BOUNDED_STRING_KEYS):
        out["maxLength"] = MAX_STRING_CHARS
    return out


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) of a constraint.

    Raises:
        InvalidRequestError: ``json`` is not a JSON object (``param``: the constraint's kind).
    """
    import llguidance

    L = llguidance.LLMatcher
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", "json") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("the JSON schema must be an object", "json")
        return L.grammar_from_json_schema(bounded_schema(schema) if isinstance(schema, dict) else schema,
                                          overrides={"whitespace_flexible": False})
    if spec.json_object:
        return L.grammar_from_lark(JSON_OBJECT_LARK)
    if spec.regex is not None:
        return L.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return L.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return L.grammar_from_lark(any_to_lark(spec.grammar))
    except Exception as e:  # the GBNF converter raises on malformed rules
        raise InvalidRequestError(f"the grammar is invalid: {e}", "grammar") from None


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens so far.

    Not thread-safe; ``fill_bitmask`` may run in another thread than the engine loop
    as long as no ``accept`` runs meanwhile (the engine computes masks during the forward).
    """

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row``: [ceil(vocab / 32)] int32, bit ``t % 32``
        of word ``t // 32`` set when token ``t`` may come next."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it (the matcher
        then stays in its error state)."""
        return bool(self._m.consume_token(token))

    def accept_all(self, tokens: list[int]) -> bool:
        """Advance past ``tokens`` (a resumed request's earlier output); False as ``accept``."""
        return bool(self._m.consume_tokens(list(tokens))) if tokens else True

    @property
    def is_terminated(self) -> bool:
        """The output is complete: the grammar allows nothing but the end of sequence."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher stopped ('' while it follows), as ``short_error``."""
        return short_error(self._m.get_error())


def short_error(message: str) -> str:
    """A grammar-engine message on one line, at most 300 characters, without the state
    dump that follows ``<state>`` (it repeats the whole grammar)."""
    text = " ".join(line.strip() for line in message.split("<state>", 1)[0].splitlines() if line.strip())
    return text if len(text) <= 300 else text[:297] + "..."


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary; compiled grammars
    are cached by constraint (LRU, ``CACHE_SIZE``), each request gets a copy.

    ``tokenizer``: the HF tokenizer, or None to load it from ``model_dir`` on first use;
    ``vocab_size``: the model's (logits width; ids past the tokenizer's are never allowed);
    ``eos_token_ids``: the ids that end a sequence (allowed once the grammar is complete).
    ``grammar`` may run on several threads at once (the engine compiles on a thread).
    ``compile_gate``: when set, every compile (a cache miss) first waits for this event: a
    test's seam to hold a compile in flight.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: frozenset[int], tokenizer=None) -> None:
        self.model_dir, self.vocab_size, self.eos = model_dir, vocab_size, sorted(eos_token_ids)
        self._hf = tokenizer
        self._ll = None
        self._lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self.compile_gate: threading.Event | None = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._checked: OrderedDict[tuple, None] = OrderedDict()  # keys ``check`` passed
        self.words = (vocab_size + 31) // 32

    def warm_up(self) -> threading.Thread:
        """Build the grammar engine's tokenizer on a thread (about 0.5 s for a 49k
        vocabulary), so that the first constrained request does not stall the engine loop."""
        def build() -> None:
            try:
                self._tokenizer()
            except Exception as e:  # the first constrained request reports it
                logger.debug("grammar tokenizer warm-up failed: %s", e)

        # not a daemon: the interpreter joins it at exit (a build killed in native code segfaulted)
        t = threading.Thread(target=build, name="epd-grammar-warm-up")
        t.start()
        return t

    def _tokenizer(self):
        with self._lock:
            return self._build_tokenizer()

    def _build_tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(self.model_dir)
            self._ll = llguidance.hf.from_tokenizer(self._hf, self.vocab_size, eos_token=self.eos or None)
        return self._ll

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for ``spec``.

        Raises:
            InvalidRequestError: the constraint does not compile (llguidance's message).
        """
        import llguidance

        key = spec.key
        with self._cache_lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
        if base is None:
            if self.compile_gate is not None:
                self.compile_gate.wait()
            base = llguidance.LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0)
            if base.is_error():
                raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: {short_error(base.get_error())}",
                                          spec.kind)
            with self._cache_lock:
                self._cache[key] = base
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Grammar(base.deep_copy())

    def is_compiled(self, spec: StructuredOutputs) -> bool:
        """Whether ``grammar(spec)`` is a cache hit (a copy, no compile)."""
        with self._cache_lock:
            return spec.key in self._cache

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` and follow it for one token (the first allowed one that does
        not end the sequence): the API's check before a request is routed. A grammar can
        compile and still exceed the engine's limits once followed (``start: "a" start``
        expands without end; ``((a{100}){100}){100}`` builds too many lexer states); that
        shows at the first mask or token, and is the client's 400 here, not a failed output.

        Raises:
            InvalidRequestError: it does not compile, or cannot be followed.
        """
        if spec.key in self._checked:
            self._checked.move_to_end(spec.key)
            return
        g = self.grammar(spec)
        row = np.zeros(self.words, dtype=np.int32)
        g.fill_bitmask(row)
        if not g.error:
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:self.vocab_size])
            token = next((int(t) for t in allowed if int(t) not in self.eos), None)
            if token is not None:
                g.accept(token)
        if g.error:
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} compiles but exceeds the grammar engine's "
                                      f"limits when followed ({g.error}); simplify it: fewer nested repetitions, "
                                      "longer lexemes", spec.kind)
        self._checked[spec.key] = None
        if len(self._checked) > CACHE_SIZE:
            self._checked.popitem(last=False)

    def bitmask(self, grammars: list[Grammar]) -> np.ndarray:
        """[len(grammars), ceil(vocab / 32)] int32: each grammar's allowed next tokens."""
        out = np.zeros((len(grammars), self.words), dtype=np.int32)
        for i, g in enumerate(grammars):
            g.fill_bitmask(out[i])
        return out

