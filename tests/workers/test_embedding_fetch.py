"""The prefill side's embedding reads (``EmbeddingFetcher``) against a real NIXL agent
holding an encoder's ``EmbeddingBuffer``: generations checked after the read, reads
held in flight (the transport's hold seam) keep their slots until they terminate."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("nixl")

from epd.messages import EmbeddingRef, ReleaseEmbeddings, decode
from epd.transfer import NixlTransport
from epd.workers.embedding_buffer import EmbeddingBuffer
from epd.workers.embedding_fetch import EmbeddingFetcher, StaleEmbeddingsError


@pytest.fixture
def pair():
    """(encoder transport, encoder buffer, reader transport, reader buffer, fetcher)."""
    enc, rd = NixlTransport("enc-0"), NixlTransport("pre-0")
    ebuf, rbuf = EmbeddingBuffer(1 << 16), EmbeddingBuffer(1 << 16)
    eregs, rregs = enc.register([ebuf.tensor]), rd.register([rbuf.tensor])
    rd.add_peer(enc.metadata(), eregs, "enc-0")
    enc.add_peer(rd.metadata(), rregs, "pre-0")
    fetcher = EmbeddingFetcher(rd, rbuf, {"enc-0": SimpleNamespace(instance_id="enc-0")}, timeout_s=10.0)
    yield enc, ebuf, rd, rbuf, fetcher
    rd.close()
    enc.close()


def _encode(ebuf: EmbeddingBuffer, rid: str, emb: torch.Tensor) -> EmbeddingRef:
    raw = emb.contiguous().view(-1).view(torch.uint8)
    off, generation = ebuf.alloc_span(rid, raw.numel())
    ebuf.view(off, raw.numel()).copy_(raw)
    return EmbeddingRef("h" * 64, ebuf.region(off, raw.numel()), list(emb.shape), "float32", "enc-0",
                        generation=generation)


def _poll_until(fetcher, enc, released: list, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        for msgs in enc.get_notifs().values():
            released.extend(decode(m).request_id for m in msgs if isinstance(decode(m), ReleaseEmbeddings))
        done, failed = fetcher.poll()
        if done or failed:
            return done, failed
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_read_checks_the_generation_and_releases_the_span(pair):
    enc, ebuf, _, rbuf, fetcher = pair
    emb = torch.randn(4, 8)
    ref = _encode(ebuf, "a", emb)
    fetcher.start("a", None, [ref], None, "payload-a")
    released: list[str] = []
    done, failed = _poll_until(fetcher, enc, released)
    assert not failed and done[0][0] == "payload-a" and torch.equal(done[0][1][0], emb)
    deadline = time.monotonic() + 5
    while "a" not in released and time.monotonic() < deadline:  # carried by the generation-word read
        released.extend(decode(m).request_id for msgs in enc.get_notifs().values() for m in msgs)
    assert released == ["a"] and not rbuf.owners()


def test_a_span_reclaimed_under_its_reader_is_never_used(pair):
    """The encoder reclaims A's span while A's read is in flight (the router ended A there)
    and writes B's embeddings at the same offset; the read then lands B's bytes, but the
    generation word read after it says the span is no longer A's: the fetch fails
    (retryable), B's data is not returned, and the slots are freed."""
    enc, ebuf, rd, rbuf, fetcher = pair
    emb_a, emb_b = torch.full((4, 8), 1.0), torch.full((4, 8), 2.0)
    ref_a = _encode(ebuf, "a", emb_a)
    rd.hold = True
    fetcher.start("a", None, [ref_a], None, "payload-a")
    assert fetcher.poll() == ([], [])
    ebuf.end("a")
    assert ebuf.expire(0.0) == ["a"]
    ref_b = _encode(ebuf, "b", emb_b)
    assert ref_b.region == ref_a.region and ref_b.generation != ref_a.generation
    rd.hold = False
    done, failed = _poll_until(fetcher, enc, [])
    assert not done and isinstance(failed[0][1], StaleEmbeddingsError) and failed[0][0] == "payload-a"
    assert not rbuf.owners()


def test_aborted_read_in_flight_keeps_its_slots_until_it_terminates(pair):
    enc, ebuf, rd, rbuf, fetcher = pair
    ref = _encode(ebuf, "a", torch.randn(4, 8))
    rd.hold = True
    fetcher.start("a", None, [ref], None, "payload-a")
    assert fetcher.abort("a")
    assert rbuf.owners() and fetcher.stats()["num_fenced_embedding_reads"] == 1  # NIXL could not cancel it
    fetcher.poll()
    assert rbuf.owners()
    rd.hold = False
    deadline = time.monotonic() + 10
    while rbuf.owners():
        assert time.monotonic() < deadline
        enc.get_notifs()
        fetcher.poll()
        time.sleep(0.001)
    assert fetcher.stats()["num_fenced_embedding_reads"] == 0 and not fetcher.in_flight()
