"""The encoder's embedding buffer: spans are reclaimed only after the router ended their
request, and freeing a span zeroes its generation word before the span can be reused."""

from __future__ import annotations

import torch

from epd.workers.embedding_buffer import GENERATION_BYTES, EmbeddingBuffer, generation_offset


def _word(buf: EmbeddingBuffer, off: int, nbytes: int) -> int:
    at = off + generation_offset(nbytes)
    return int(buf.view(at, GENERATION_BYTES).view(torch.int64)[0])


def test_a_running_request_is_never_reclaimed_by_the_ttl():
    buf = EmbeddingBuffer(4096)
    off, generation = buf.alloc_span("a", 100)
    assert generation and _word(buf, off, 100) == generation
    assert buf.expire(0.0) == [] and buf.owners() == {"a"}  # no timer frees a span its reader may still read
    buf.end("a")  # the router ended the request
    assert buf.expire(60.0) == [] and buf.owners() == {"a"}
    assert buf.expire(0.0) == ["a"] and not buf.owners()
    assert _word(buf, off, 100) == 0  # a late reader reads a mismatch


def test_free_zeroes_the_word_and_a_reused_span_gets_a_new_generation():
    buf = EmbeddingBuffer(4096)
    off, g1 = buf.alloc_span("a", 64)
    buf.free("a")
    off2, g2 = buf.alloc_span("b", 64)
    assert off2 == off and g2 != g1 and _word(buf, off, 64) == g2
    buf.end("gone")  # an owner holding nothing: nothing to reclaim later
    assert buf.expire(0.0) == []
