"""Multimodal sequences on the decode side of a KV transfer.

A decode worker gets a multimodal request's prompt KV from a prefill worker; it
never sees the media embeddings. ``ReserveKV`` carries the placeholders, so the
decode-side sequence's block hashes include the item hashes, and the scheduler
never recomputes media positions it has no embeddings for (see the docstring of
``epd.engine.scheduler``).
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from epd import LLM, SamplingParams
from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler
from epd.messages import KVReserved, ReserveKV
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from epd.multimodal import Placeholder
from epd.sequence import Sequence, SequenceStatus
from epd.transfer.kv_receiver import NixlKVReceiver

BS = 4
HASH_A, HASH_B = "a" * 64, "b" * 64


def _remote_seq(request_id: str, n_prompt: int, placeholders: list[Placeholder], max_tokens: int = 8) -> Sequence:
    """A sequence as a decode worker holds it: placeholders, no embeddings."""
    seq = Sequence(request_id, [(7 + i) % 97 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens))
    seq.mm_placeholders = list(placeholders)
    return seq


def _admit_remote(sched: Scheduler, *seqs: Sequence) -> None:
    """Reserve each sequence's prompt blocks and mark its KV arrived (what the
    receiver does on KVReserved + KVReady), with a first token from "prefill"."""
    for seq in seqs:
        assert sched.add_remote(seq)
        seq.token_ids.append(500)
        sched.remote_kv_ready(seq.request_id)


def _step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.seq.seq_id: 600 + s.seq.num_tokens for s in out.scheduled if s.sample}
    sched.update(out, sampled)
    return out


# ---- the receiving side hashes media blocks with their item hashes ------------------

@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("remote-mm") / "llava"))


def test_reserved_sequences_with_other_images_get_other_block_hashes(tiny_model_dirs):
    """Same tokens, same placeholder span, different item hashes: after the KV
    arrived, no full block of one hashes like the other's (so after a preemption
    neither can hit the other's image KV in the prefix cache)."""
    llm = LLM(tiny_model_dirs["llama"], block_size=BS, dtype="float32")
    try:
        engine = llm.engine
        receiver = NixlKVReceiver(engine, None, None, "d0")
        ids = list(range(10, 30))  # 5 blocks of 4; the "image" spans positions 2..9
        replies = []
        for rid, item in (("a", HASH_A), ("b", HASH_B), ("a2", HASH_A)):
            replies += receiver.add(ReserveKV(rid, ids, SamplingParams(max_tokens=4),
                                              [Placeholder(2, 8, item)]))
        assert [type(r) for r in replies] == [KVReserved] * 3
        seqs = {}
        for rid in ("a", "b", "a2"):
            engine.add_prefilled(rid, 5)
            seqs[rid] = engine.requests[rid].seq
        bm = engine.block_manager
        hashes = {rid: bm.block_hashes(seq, len(ids) // BS) for rid, seq in seqs.items()}
        assert all(s.mm_placeholders == [Placeholder(2, 8, h)] for s, h in zip(seqs.values(), (HASH_A, HASH_B, HASH_A)))
        assert not set(hashes["a"]) & set(hashes["b"])  # block 0 overlaps the image: every hash differs
        assert hashes["a"] == hashes["a2"]  # the same image keeps sharing
        cached = [bm.blocks[b].block_hash for b in seqs["b"].block_table[:len(ids) // BS]]
        assert cached == hashes["b"]
    finally:
        llm.shutdown()


# ---- the scheduler never recomputes media positions without embeddings ---------------

def test_a_media_sequence_without_embeddings_is_not_the_preemption_victim():
    # 5 blocks of 4: t (text, 8 tokens computed: 2 blocks), m (media, 11 tokens: 3 blocks).
    sched = Scheduler(BlockManager(5, BS), max_num_seqs=8, max_num_batched_tokens=32)
    t = Sequence("t", list(range(3, 11)), SamplingParams(max_tokens=8))
    sched.add(t)
    _step(sched)
    m = _remote_seq("m", 11, [Placeholder(1, 8, HASH_A)])
    _admit_remote(sched, m)
    assert sched.running == [t, m] and sched.block_manager.num_free_blocks == 0
    # t's decode (position 8) needs a block. m is the newest running sequence but
    # cannot be recomputed: t preempts itself, m keeps its KV and runs.
    out = _step(sched)
    assert out.num_preempted == 1 and t.status is SequenceStatus.WAITING
    assert m.status is SequenceStatus.RUNNING and len(m.block_table) == 3
    assert [s.seq for s in out.scheduled] == [m]


def _two_media_sequences_at_the_last_resort(max_tokens_a: int):
    """8 blocks of 4: a and b (11 prompt tokens, 3 blocks each) decode until both need
    a 5th block at position 16; neither may preempt the other, so nothing can run and
    the newest (b) gives its blocks up: a runs."""
    sched = Scheduler(BlockManager(8, BS), max_num_seqs=8, max_num_batched_tokens=32)
    a = _remote_seq("a", 11, [Placeholder(1, 8, HASH_A)], max_tokens=max_tokens_a)
    b = _remote_seq("b", 11, [Placeholder(1, 8, HASH_B)], max_tokens=20)
    _admit_remote(sched, a, b)
    for _ in range(5):  # positions 11..15
        out = _step(sched)
        assert out.num_preempted == 0 and len(out.scheduled) == 2
    assert sched.block_manager.num_free_blocks == 0
    out = _step(sched)
    assert out.num_preempted == 1 and b.status is SequenceStatus.WAITING and b.block_table == []
    assert [s.seq for s in out.scheduled] == [a] and not out.failed
    return sched, a, b


def _run(sched: Scheduler, a: Sequence, until) -> list[Sequence]:
    """Step (finishing ``a`` at its max_tokens) until ``until(out)``; the failed sequences."""
    failed = []
    for _ in range(100):
        out = _step(sched)
        failed += out.failed
        if a.status is SequenceStatus.RUNNING and a.num_output_tokens >= a.params.max_tokens:
            sched.finish(a, "length")
        if until(out):
            return failed
    raise AssertionError("did not get there")


def test_media_sequences_stall_and_the_newest_is_preempted_only_when_nothing_runs():
    sched, a, b = _two_media_sequences_at_the_last_resort(max_tokens_a=8)
    # a needs one more block (b's tail block 3); b's media blocks 0..2 stay cached
    # under b's own hashes, and b resumes after them, recomputing text only.
    resumed = []
    failed = _run(sched, a, lambda out: resumed.extend(s for s in out.scheduled if s.seq is b) or resumed)
    assert not failed and a.is_finished and b.status is SequenceStatus.RUNNING
    assert resumed[0].start == 12  # media (positions 1..8) came from its cached blocks 0..2


def test_a_media_sequence_whose_media_kv_was_evicted_fails_instead_of_recomputing():
    sched, a, b = _two_media_sequences_at_the_last_resort(max_tokens_a=40)
    # a grows over b's cached blocks, evicting b's media KV: b can never be rebuilt
    # here and ends with "error" instead of being recomputed from placeholders.
    failed = _run(sched, a, lambda out: b.is_finished)
    assert failed == [b] and b.finish_reason == "error" and b.block_table == []
    assert a.status is SequenceStatus.RUNNING


# ---- end to end in one process: P -> D with the KV copied, decode cache too small -----

class _HoldKV:
    """A ``KVConnectorHooks`` that keeps each finished prompt's blocks (as the KV
    sender does until its writes are done), so the test can copy its KV."""

    def __init__(self) -> None:
        self.held: dict[str, Sequence] = {}

    def build_step(self, sched):
        return None

    def request_finished(self, seq) -> bool:
        self.held[seq.request_id] = seq
        return True


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def pd_engines(llava_dir):
    """A prefill engine (the aggregated reference too) and a decode engine of 12
    blocks of 8 (96 tokens), too small for two image requests at once."""
    p = LLM(llava_dir, block_size=8, dtype="float32")
    d = LLM(llava_dir, block_size=8, num_kv_blocks=12, dtype="float32")
    yield p, d
    p.shutdown()
    d.shutdown()


def _prefill_into(p: LLM, receiver: NixlKVReceiver, hold: _HoldKV, rid: str, prompt: dict,
                  params: SamplingParams) -> KVReserved:
    """Prefill ``prompt`` on ``p``, reserve on the decode side through ``receiver``, copy
    the prompt's KV into the reserved blocks (NIXL's job: only those after the decode
    side's own prefix hits) and start decoding. Returns the reservation."""
    _, ids, mm = p._prepare(prompt)
    p.engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1), **mm)
    first = [o for o in p.engine.step() if o.request_id == rid][0].outputs[0].token_ids[0]
    (reserved,) = receiver.add(ReserveKV(rid, ids, params, mm["mm_placeholders"]))
    src = hold.held.pop(rid)
    n = -(-len(ids) // 8)
    assert reserved.num_cached_blocks + len(reserved.block_ids) == n  # the decode side's own prefix hits first
    d = receiver.engine
    for name in ("k_cache", "v_cache"):
        getattr(d.runner, name)[:, reserved.block_ids] = \
            getattr(p.engine.runner, name)[:, src.block_table[reserved.num_cached_blocks:n]]
    p.engine.block_manager.free(src)
    d.add_prefilled(rid, first)
    return reserved


@pytest.mark.parametrize("max_tokens", [20, 40])
def test_disaggregated_media_requests_under_decode_preemption(max_tokens, pd_engines):
    """Two requests with the same text and different images decode concurrently in a
    KV cache too small for both; the newest is preempted. With 20 tokens each equals
    the aggregated engine's answer: the preempted one resumes after its own cached
    image blocks (it must not hit the other's image KV, nor recompute its image from
    placeholders). With 40 the other one evicts its image blocks: it ends with
    finish_reason "error" after a correct prefix instead of going on wrongly."""
    p, d = pd_engines
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tok = p.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": f"{IMAGE_TOKEN} What is this?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [{"prompt": text, "multi_modal_data": {"image": [_image(s)]}} for s in (1, 2)]
    expected = [list(o.outputs[0].token_ids) for o in p.generate(prompts, params)]
    assert expected[0] != expected[1]
    hold = _HoldKV()
    p.engine.kv_connector = hold
    receiver = NixlKVReceiver(d.engine, None, None, "d0")
    preemptions = d.engine.stats()["num_preemptions"]
    try:
        for i, prompt in enumerate(prompts):
            _prefill_into(p, receiver, hold, f"r{max_tokens}-{i}", prompt, params)
    finally:
        p.engine.kv_connector = None
    done = {}
    while len(done) < 2:
        for out in d.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert d.engine.stats()["num_preemptions"] > preemptions
    first, second = done[f"r{max_tokens}-0"], done[f"r{max_tokens}-1"]
    assert list(first.token_ids) == expected[0] and first.finish_reason == "length"
    if max_tokens == 20:
        assert list(second.token_ids) == expected[1] and second.finish_reason == "length"
    else:
        assert second.finish_reason == "error"
        assert 0 < len(second.token_ids) < max_tokens
        assert list(second.token_ids) == expected[1][:len(second.token_ids)]
    assert d.engine.stats()["num_free_blocks"] == 12


def _decode_all(d: LLM) -> dict:
    done = {}
    while d.engine.scheduler.has_unfinished():
        for out in d.engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_decode_side_reuse_across_turns_keyed_by_image(pd_engines):
    """Decode-side reuse: a follow-up turn (the first turn's prompt and answer, then more
    text, same image) reserves the decode instance's cached blocks of the first turn, and
    only the rest is copied in; the answer equals the aggregated engine's. The same text
    with another image hits only the blocks before the image placeholder (the item hash
    keys the blocks), and its answer is that image's."""
    p, d = pd_engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = p.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": f"{IMAGE_TOKEN} Describe it."}],
                                   add_generation_prompt=True, tokenize=False)
    hold = _HoldKV()
    p.engine.kv_connector = hold
    receiver = NixlKVReceiver(d.engine, None, None, "d0")
    try:
        first = {"prompt": text, "multi_modal_data": {"image": [_image(5)]}}
        r1 = _prefill_into(p, receiver, hold, "turn-1", first, params)
        answer = _decode_all(d)["turn-1"]
        follow = {"prompt": text + tok.decode(answer) + " And the colours?", "multi_modal_data": {"image": [_image(5)]}}
        other = {"prompt": text, "multi_modal_data": {"image": [_image(6)]}}
        p.engine.kv_connector = None
        expected = [list(o.outputs[0].token_ids) for o in p.generate([follow, other], params)]
        p.engine.kv_connector = hold
        r2 = _prefill_into(p, receiver, hold, "turn-2", follow, params)
        done = _decode_all(d)
        r3 = _prefill_into(p, receiver, hold, "other-image", other, params)
        done.update(_decode_all(d))
    finally:
        p.engine.kv_connector = None
    _, ids1, mm1 = p._prepare(first)
    assert r1.num_cached_blocks == 0
    assert r2.num_cached_blocks >= len(ids1) // 8 - 1 > 0  # the first turn's blocks (but a boundary one)
    assert r3.num_cached_blocks == mm1["mm_placeholders"][0].offset // 8  # not the other image's blocks
    assert done["turn-2"] == expected[0] and done["other-image"] == expected[1]
    assert receiver.stats()["kv_reused_blocks"] == r2.num_cached_blocks + r3.num_cached_blocks
    assert d.engine.stats()["num_free_blocks"] == 12
