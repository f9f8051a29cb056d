"""LayerGate: a layer's KV sends are posted only once its device work is done, in layer
order, each once; the forward never waits except at the end (flush)."""

from __future__ import annotations

import pytest

from epd.engine.layer_gate import LayerGate


class _Event:
    """An event the test completes by hand (a CUDA event's query/synchronize)."""

    def __init__(self, log: list):
        self.done = False
        self.waited = False
        self.log = log

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True
        self.log.append("wait")


def _gate():
    log, events = [], []

    def new_event():
        events.append(_Event(log))
        return events[-1]

    return LayerGate("cpu", new_event=new_event), events, log


def test_on_the_cpu_sends_run_at_once():
    sent = []
    gate = LayerGate("cpu")
    gate.push(0, sent.append)
    gate.push(1, sent.append)
    assert sent == [0, 1]
    gate.flush()
    assert sent == [0, 1]


def test_a_send_waits_for_its_layer_and_keeps_order():
    gate, events, log = _gate()
    gate.push(0, log.append)
    assert log == []  # layer 0's kernels have not run: nothing posted
    gate.push(1, log.append)
    events[1].done = True  # layer 1 finished first: still behind layer 0
    gate.push(2, log.append)
    assert log == []
    events[0].done = True
    gate.push(3, log.append)  # layer 3's hook polls: 0 and 1 are ready, 2 is not
    assert log == [0, 1]
    assert gate.posted_early == 2
    gate.flush()
    assert log == [0, 1, "wait", 2, "wait", 3]
    assert gate.posted_at_flush == 2
    assert not any(e.waited for e in events[:2])  # the early ones were never waited on


def test_flush_posts_each_send_once():
    gate, events, log = _gate()
    for layer in range(3):
        gate.push(layer, log.append)
    gate.flush()
    gate.flush()
    assert [x for x in log if x != "wait"] == [0, 1, 2]


def test_discard_after_a_failed_forward_posts_nothing():
    gate, events, log = _gate()
    gate.push(0, log.append)
    gate.discard()
    events[0].done = True
    gate.flush()
    gate.push(1, lambda layer: log.append(("next step", layer)))
    events[1].done = True
    gate.poll()
    assert log == [("next step", 1)]


def test_a_failing_send_propagates_and_keeps_the_rest_queued():
    gate, events, log = _gate()

    def bad(layer):
        raise RuntimeError(f"layer {layer}")

    gate.push(0, bad)
    gate.push(1, log.append)
    events[0].done = events[1].done = True
    with pytest.raises(RuntimeError, match="layer 0"):
        gate.poll()
    gate.poll()
    assert log == [1]
