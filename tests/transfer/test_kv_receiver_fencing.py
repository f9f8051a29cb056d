"""The decode side's KV notifications: only the named writer counts, and a lost router
leaves reservations fenced until their writer says it will never write.

The receiver runs on a real engine (tiny llama); its notifications come from a
queue standing in for NIXL's notification inbox (``get_notifs``: sender agent name
-> raw messages), so a test can say which agent sent what.
"""

from __future__ import annotations

from epd import LLM, SamplingParams
from epd.messages import KVReady, KVReserved, KVWriterDone, KVWriterFenced, ReserveKV, encode
from epd.transfer.kv_receiver import NixlKVReceiver


class Inbox:
    """Notifications as NIXL hands them over: per sender agent, in order."""

    def __init__(self) -> None:
        self.queued: dict[str, list[bytes]] = {}

    def put(self, sender: str, msg) -> None:
        self.queued.setdefault(sender, []).append(encode(msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        out, self.queued = self.queued, {}
        return out


def _setup(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=16, num_kv_blocks=64, dtype="float32")
    inbox = Inbox()
    return llm, inbox, NixlKVReceiver(llm.engine, inbox, None, "decode-0")


def _reserve(receiver, rid: str, writer: str) -> KVReserved:
    (reply,) = receiver.add(ReserveKV(rid, list(range(10, 50)), SamplingParams(max_tokens=4), kv_writer=writer))
    assert isinstance(reply, KVReserved)
    return reply


def test_only_the_named_writer_admits_a_reservation(tiny_model_dirs):
    llm, inbox, receiver = _setup(tiny_model_dirs)
    try:
        r = _reserve(receiver, "a", "prefill-0")
        inbox.put("prefill-1", KVReady("a", 7, generation=r.generation))  # right generation, wrong sender
        inbox.put("prefill-1", KVWriterDone("a", r.generation))
        receiver.poll()
        assert "a" in receiver.reserved and not receiver.reserved["a"].writer_done
        inbox.put("prefill-0", KVReady("a", 7, generation=r.generation))
        receiver.poll()
        assert "a" not in receiver.reserved and "a" in llm.engine.requests  # admitted: it decodes now
    finally:
        llm.shutdown()


def test_router_lost_keeps_reservations_fenced_until_their_writer_fences(tiny_model_dirs):
    """What ``DecodeWorker.router_lost`` does: each pending reservation is aborted with
    its expected writer; its blocks stay out of the pool until that writer's
    ``KVWriterFenced`` (another writer's changes nothing), then all return."""
    llm, inbox, receiver = _setup(tiny_model_dirs)
    try:
        bm = llm.engine.block_manager
        free0 = bm.num_free_blocks
        _reserve(receiver, "a", "prefill-0")
        _reserve(receiver, "b", "prefill-1")
        for rid in list(receiver.in_flight()):
            receiver.abort(rid, *receiver.expected_writer(rid))
        assert receiver.fenced() == {"a", "b"} and not receiver.in_flight()
        assert bm.num_free_blocks < free0
        inbox.put("prefill-1", KVWriterFenced())
        receiver.poll()
        assert receiver.fenced() == {"a"}
        receiver.writer_gone("prefill-9", 1)  # someone else's exit frees nothing
        assert receiver.fenced() == {"a"}
        receiver.writer_gone("prefill-0", 4321)  # any process of the named writer: it wrote nothing since
        assert receiver.fenced() == set() and bm.num_free_blocks == free0
    finally:
        llm.shutdown()


def test_a_fence_before_the_loss_was_noticed_still_counts(tiny_model_dirs):
    """The prefill worker may notice the lost router first: its ``KVWriterFenced``
    arrives while the reservation is still live; the later abort releases at once."""
    llm, inbox, receiver = _setup(tiny_model_dirs)
    try:
        free0 = llm.engine.block_manager.num_free_blocks
        _reserve(receiver, "a", "prefill-0")
        inbox.put("prefill-0", KVWriterFenced())
        receiver.poll()
        receiver.abort("a", *receiver.expected_writer("a"))
        assert not receiver.reserved and llm.engine.block_manager.num_free_blocks == free0
    finally:
        llm.shutdown()
