"""A grammar compiles off the engine loop (issue 34, item 12e).

A constraint whose grammar is not compiled yet waits for its compile on a thread (vLLM's
WAITING_FOR_FSM) while the other requests keep decoding; it runs once compiled. A
constraint that does not compile ends its own request with finish_reason ``"error"``
and llguidance's reason (the worker's 400), and nothing else. The compile is held in
flight by ``GrammarCompiler.compile_gate``.
"""

from __future__ import annotations

import re
import threading

import pytest

from epd import LLM, SamplingParams
from epd.structured_outputs import StructuredOutputs


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from epd.models.tiny import create_tiny_model

    engine = LLM(str(create_tiny_model("llama", tmp_path_factory.mktemp("grammar") / "llama")), block_size=8,
                 dtype="float32")
    yield engine
    engine.shutdown()


def _steps(engine, n: int) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(n):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_a_compiling_grammar_does_not_stall_running_requests(llm):
    engine, tok = llm.engine, llm.engine.tokenizer
    gate = threading.Event()
    engine.grammars.compile_gate = gate
    try:
        engine.add_request("free", tok.encode("hello world"), SamplingParams(max_tokens=6, temperature=0.0))
        held = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(regex="(ab){1,3}c"))
        add = threading.Thread(target=engine.add_request, args=("held", tok.encode("hello there"), held))
        add.start()
        add.join(timeout=30)
        assert not add.is_alive(), "add_request waited for the grammar's compile"
        assert engine.num_compiling == 1
        outs = _steps(engine, 6)
        free = outs["free"]
        assert len(free) == 6 and free[-1].finished, "the running request stalled behind a compile"
        assert "held" not in outs and engine.num_compiling == 1  # still compiling: not run
    finally:
        gate.set()
        engine.grammars.compile_gate = None
    outs: dict[str, list] = {}
    for _ in range(200):
        for rid, o in _steps(engine, 1).items():
            outs.setdefault(rid, []).extend(o)
        if outs.get("held") and outs["held"][-1].finished:
            break
    comp = outs["held"][-1].outputs[0]
    assert comp.finish_reason == "stop" and re.fullmatch("(ab){1,3}c", comp.text), comp


def test_a_grammar_that_does_not_compile_fails_its_request_only(llm):
    engine, tok = llm.engine, llm.engine.tokenizer
    engine.add_request("ok", tok.encode("hello world"), SamplingParams(max_tokens=5, temperature=0.0))
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputs(grammar='start: "a" missing_rule'))
    engine.add_request("bad", tok.encode("hello world"), bad)
    outs: dict[str, list] = {}
    for _ in range(50):
        for rid, o in _steps(engine, 1).items():
            outs.setdefault(rid, []).extend(o)
        if not engine.has_unfinished_requests():
            break
    (failed,) = outs["bad"]
    comp = failed.outputs[0]
    assert failed.finished and comp.finish_reason == "error" and not comp.token_ids
    assert isinstance(comp.stop_reason, str) and "grammar" in comp.stop_reason, comp.stop_reason
    assert len(outs["ok"]) == 5 and outs["ok"][-1].outputs[0].finish_reason == "length"
