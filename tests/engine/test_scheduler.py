"""Scheduler: token budget, chunked prefill, decode priority, max_num_seqs,
preemption by recompute, sample flags and finish().

The model is simulated: each step's sampled token is a pure function of the
sequence and its position, so lost or duplicated tokens show up in the outputs.
"""

from __future__ import annotations

from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler, SchedulerOutput
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence, SequenceStatus

BS = 4


def make_sched(num_blocks=64, max_num_seqs=8, budget=16, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, prefix), max_num_seqs, budget)


def make_seq(n_prompt: int, max_tokens: int = 4, first: int = 0, request_id: str = "r") -> Sequence:
    return Sequence(request_id, [(first + i) % 97 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens))


def fake_token(seq: Sequence) -> int:
    """The token "the model" produces after ``seq.token_ids``: depends on the position only."""
    return 1000 + seq.num_tokens


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[tuple[Sequence, int, int, bool]]]:
    """One engine step: schedule, sample where a chunk reaches the end, update, finish on length."""
    waiting_before = len(sched.waiting)
    out = sched.schedule()
    if out.num_preempted:
        # A step that had to preempt admits nobody from the queue (not even the victim).
        assert len(sched.waiting) == waiting_before + out.num_preempted
        assert all(s.seq.status is SequenceStatus.RUNNING and s.seq not in sched.waiting for s in out.scheduled)
    # ``sample`` depends on the sequence's current length: read it before update().
    view = [(s.seq, s.start, s.num_tokens, s.sample) for s in out.scheduled]
    sampled = {s.seq.seq_id: fake_token(s.seq) for s in out.scheduled if s.sample}
    changed = sched.update(out, sampled)
    for seq in changed:
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return out, view


def expected_output(seq: Sequence) -> list[int]:
    return [1000 + seq.num_prompt_tokens + i for i in range(seq.params.max_tokens)]


def check_step_invariants(sched: Scheduler, out: SchedulerOutput, view) -> None:
    bm = sched.block_manager
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    ids = [seq.seq_id for seq, *_ in view]
    assert len(ids) == len(set(ids))  # a sequence runs at most once per step
    for seq, start, n, _ in view:
        assert n >= 1
        # The chunk's KV slots exist.
        assert len(seq.block_table) * BS >= start + n or seq.is_finished
    # Free-list invariant: a block is free iff its ref_count is 0.
    for blk in bm.blocks:
        assert (blk.ref_count == 0) == (blk.block_id in bm.free_blocks)
    if not bm.enable_prefix_caching:
        tables = [b for seq in sched.running for b in seq.block_table]
        assert len(tables) == len(set(tables))  # no block shared between running sequences


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_steps: int = 1000) -> list:
    for s in seqs:
        sched.add(s)
    history = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out, view = step(sched)
        check_step_invariants(sched, out, view)
        history.append((out, view))
    assert not sched.has_unfinished()
    return history


# ---- budget and chunking -----------------------------------------------------

def test_token_budget_respected_and_every_request_completes_exactly():
    sched = make_sched(num_blocks=64, max_num_seqs=4, budget=10)
    seqs = [make_seq(n, max_tokens=m, first=n) for n, m in [(23, 3), (1, 5), (9, 2), (10, 1), (31, 4), (4, 6)]]
    history = run_to_completion(sched, seqs)
    assert max(out.num_tokens for out, _ in history) == 10  # the budget is actually used
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length"
        assert s.output_token_ids == expected_output(s)
        assert s.block_table == []
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sched = make_sched(budget=8)
    s = make_seq(25, max_tokens=3)
    sched.add(s)
    chunks = []
    for _ in range(6):
        out, view = step(sched)
        assert len(view) == 1
        chunks.append(view[0][1:])
        assert out.num_tokens <= 8
    assert chunks == [
        (0, 8, False), (8, 8, False), (16, 8, False), (24, 1, True),  # prefill
        (25, 1, True), (26, 1, True),  # decodes
    ]
    assert s.is_finished and s.output_token_ids == expected_output(s)


def test_intermediate_chunks_add_no_token_and_advance_num_computed():
    sched = make_sched(budget=5)
    s = make_seq(12, max_tokens=2)
    sched.add(s)
    out, view = step(sched)
    assert view == [(s, 0, 5, False)]
    assert s.num_tokens == 12 and s.num_computed_tokens == 5
    out, view = step(sched)
    assert view == [(s, 5, 5, False)]
    assert s.num_tokens == 12 and s.num_computed_tokens == 10
    out, view = step(sched)
    assert view == [(s, 10, 2, True)]
    assert s.num_tokens == 13 and s.num_computed_tokens == 12


def test_sample_flag_is_true_only_when_the_chunk_reaches_the_end():
    sched = make_sched(budget=6)
    s = make_seq(13, max_tokens=1)
    sched.add(s)
    out = sched.schedule()
    (ss,) = out.scheduled
    assert (ss.start, ss.num_tokens, ss.sample) == (0, 6, False)
    sched.update(out, {})
    out = sched.schedule()
    (ss,) = out.scheduled
    assert (ss.start, ss.num_tokens, ss.sample) == (6, 6, False)
    sched.update(out, {})
    out = sched.schedule()
    (ss,) = out.scheduled
    assert (ss.start, ss.num_tokens, ss.sample) == (12, 1, True)
    changed = sched.update(out, {s.seq_id: 5})
    assert changed == [s] and s.token_ids[-1] == 5


# ---- ordering and limits -------------------------------------------------------

def test_decodes_are_scheduled_before_new_prefills():
    sched = make_sched(budget=8)
    a = make_seq(4, max_tokens=10, first=1)
    b = make_seq(4, max_tokens=10, first=2)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled
    c = make_seq(20, max_tokens=1, first=3)
    sched.add(c)
    out, view = step(sched)
    assert view[:2] == [(a, 4, 1, True), (b, 4, 1, True)]
    assert view[2] == (c, 0, 6, False)  # the new prefill gets what the decodes left
    assert out.num_tokens == 8


def test_decodes_can_use_the_whole_budget_and_block_new_prefills():
    sched = make_sched(budget=2)
    a, b = make_seq(1, max_tokens=10, first=1), make_seq(1, max_tokens=10, first=2)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status is b.status is SequenceStatus.RUNNING
    c = make_seq(3, first=3)
    sched.add(c)
    for _ in range(3):
        out, view = step(sched)
        assert [v[0] for v in view] == [a, b]
        assert c.status is SequenceStatus.WAITING and c.block_table == []


def test_max_num_seqs_is_respected():
    sched = make_sched(max_num_seqs=2, budget=100)
    seqs = [make_seq(3, max_tokens=2, first=i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, view = step(sched)
    assert [v[0] for v in view] == seqs[:2]
    assert len(sched.running) == 2 and list(sched.waiting) == seqs[2:]
    out, view = step(sched)  # the two finish; nobody new yet (admission precedes finishing)
    assert [v[0] for v in view] == seqs[:2]
    assert seqs[0].is_finished and seqs[1].is_finished
    out, view = step(sched)
    assert [v[0] for v in view] == seqs[2:4]
    history = run_to_completion(sched, [])
    assert all(len(v) <= 2 for _, v in history)
    assert all(s.output_token_ids == expected_output(s) for s in seqs)


# ---- preemption ------------------------------------------------------------

def test_newest_running_sequence_is_preempted_and_recomputed():
    # 4 blocks of 4 tokens. a: 8-token prompt (2 blocks, full), b: 7 tokens (2 blocks).
    sched = make_sched(num_blocks=4, budget=32, prefix=False)
    a = make_seq(8, max_tokens=3, first=10, request_id="a")
    b = make_seq(7, max_tokens=3, first=20, request_id="b")
    sched.add(a)
    sched.add(b)
    out, view = step(sched)
    assert view == [(a, 0, 8, True), (b, 0, 7, True)]
    assert sched.block_manager.num_free_blocks == 0

    # a's decode (position 8) needs a third block: b, the newest, is preempted.
    out, view = step(sched)
    assert out.num_preempted == 1 and sched.num_preemptions == 1
    assert view == [(a, 8, 1, True)]
    assert b.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_tokens == 8 and b.output_token_ids == [1007]  # its sampled token is kept

    # a finishes, then b is recomputed from scratch (prompt + its output so far).
    out, view = step(sched)
    assert view == [(a, 9, 1, True)] and a.is_finished
    out, view = step(sched)
    assert view == [(b, 0, 8, True)]
    run_to_completion(sched, [])
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert sched.block_manager.num_free_blocks == 4


def test_a_sequence_that_is_itself_the_newest_preempts_itself():
    # a: 7 tokens (room for one more in block 1), b: 8 tokens (its decode needs block 2).
    sched = make_sched(num_blocks=4, budget=32, prefix=False)
    a = make_seq(7, max_tokens=2, first=10)
    b = make_seq(8, max_tokens=2, first=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    out, view = step(sched)
    assert out.num_preempted == 1
    assert view == [(a, 7, 1, True)]  # a keeps running, untouched
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert a.is_finished
    run_to_completion(sched, [])
    assert b.output_token_ids == expected_output(b)


def test_preempted_sequences_go_to_the_front_of_the_queue():
    sched = make_sched(num_blocks=3, budget=32, max_num_seqs=8, prefix=False)
    a = make_seq(4, max_tokens=3, first=1)
    b = make_seq(3, max_tokens=3, first=2)
    c = make_seq(3, max_tokens=3, first=3)
    d = make_seq(9, max_tokens=1, first=4)  # 3 blocks: cannot be admitted while others run
    for s in (a, b, c, d):
        sched.add(s)
    out, view = step(sched)
    assert [v[0] for v in view] == [a, b, c]
    assert list(sched.waiting) == [d]
    # a's decode needs a block: c (newest) is preempted and queued ahead of d.
    out, view = step(sched)
    assert out.num_preempted == 1 and [v[0] for v in view] == [a, b]
    assert list(sched.waiting) == [c, d]
    # b's decode needs a block: b is now the newest running sequence.
    out, view = step(sched)
    assert out.num_preempted == 1 and view == [(a, 5, 1, True)]
    assert list(sched.waiting) == [b, c, d]
    assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in (b, c))
    assert b.num_tokens == 5 and c.num_tokens == 4  # generated tokens survive preemption
    out, view = step(sched)
    assert view == [(b, 0, 5, True), (c, 0, 4, True)]
    run_to_completion(sched, [])
    for s in (a, b, c, d):
        assert s.output_token_ids == expected_output(s)


def test_preemption_with_prefix_cache_resumes_after_the_cached_block():
    sched = make_sched(num_blocks=4, budget=32, prefix=True)
    a = make_seq(8, max_tokens=3, first=10)
    b = make_seq(7, max_tokens=3, first=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    out, _ = step(sched)
    assert out.num_preempted == 1 and b.status is SequenceStatus.WAITING
    out, view = step(sched)
    assert a.is_finished
    # b's first block (4 prompt tokens) was hashed before preemption and never evicted.
    out, view = step(sched)
    assert view == [(b, 4, 4, True)]
    assert b.num_cached_tokens == 0  # recorded at the first admission only
    run_to_completion(sched, [])
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)


def test_stress_small_cache_many_requests():
    for prefix in (False, True):
        sched = make_sched(num_blocks=9, max_num_seqs=5, budget=7, prefix=prefix)
        seqs = [make_seq(n, max_tokens=m, first=i * 7) for i, (n, m) in
                enumerate([(13, 5), (5, 9), (2, 12), (17, 3), (6, 6), (9, 8), (3, 3), (11, 7)])]
        run_to_completion(sched, seqs)
        assert sched.num_preemptions > 0  # the cache really is too small
        for s in seqs:
            assert s.output_token_ids == expected_output(s)
        assert sched.block_manager.num_free_blocks == 9


# ---- prefix hits through the scheduler ------------------------------------------

def test_prefix_hit_starts_the_prefill_after_the_cached_blocks():
    sched = make_sched(budget=64)
    a = make_seq(10, max_tokens=1, first=5)
    run_to_completion(sched, [a])
    b = make_seq(13, max_tokens=1, first=5)  # same first 10 tokens
    sched.add(b)
    out, view = step(sched)
    assert view == [(b, 8, 5, True)]
    assert b.num_cached_tokens == 8
    assert sched.block_manager.prefix_cache_hits == 8


# ---- finish ------------------------------------------------------------------

def test_finish_frees_blocks_in_any_state():
    sched = make_sched(num_blocks=16, budget=6, max_num_seqs=8)
    bm = sched.block_manager
    running = make_seq(4, max_tokens=10, first=1)
    partial = make_seq(20, max_tokens=10, first=2)  # mid chunked prefill
    waiting = make_seq(5, max_tokens=10, first=3)
    for s in (running, partial, waiting):
        sched.add(s)
    step(sched)
    assert running.status is SequenceStatus.RUNNING
    assert partial.status is SequenceStatus.RUNNING and partial.num_computed_tokens < partial.num_tokens
    assert waiting.status is SequenceStatus.WAITING

    held = len(partial.block_table)
    free_before = bm.num_free_blocks
    sched.finish(partial, "abort")
    assert partial.is_finished and partial.finish_reason == "abort"
    assert partial not in sched.running and partial.block_table == []
    assert bm.num_free_blocks == free_before + held

    sched.finish(waiting, "abort")
    assert waiting.is_finished and waiting not in sched.waiting

    sched.finish(running, "stop", 7)
    assert (running.finish_reason, running.stop_reason) == ("stop", 7)
    sched.finish(running, "abort")  # a second finish is a no-op (no double free)
    assert running.finish_reason == "stop"
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_finish_a_preempted_sequence():
    sched = make_sched(num_blocks=4, budget=32, prefix=False)
    a = make_seq(8, max_tokens=5, first=10)
    b = make_seq(7, max_tokens=5, first=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert b.status is SequenceStatus.WAITING and b in sched.waiting
    sched.finish(b, "abort")
    assert b not in sched.waiting and b.is_finished
    sched.finish(a, "abort")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 4


def test_prefix_lookup_counted_once_per_admission():
    """A request that waits several steps for blocks is counted once, when admitted."""
    sched = make_sched(num_blocks=4, max_num_seqs=4, budget=64)
    big = make_seq(14, max_tokens=1, request_id="big")  # 4 blocks: the whole cache
    small = make_seq(5, max_tokens=1, first=50, request_id="small")
    sched.add(big)
    sched.add(small)
    for _ in range(6):
        step(sched)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.block_manager.prefix_cache_queries == 14 + 5


# ---- stall-free batching (Sarathi-Serve) -------------------------------------

def test_stall_free_prefill_share_is_capped_while_sequences_decode():
    """While two sequences decode, a long prompt gets at most ``cap`` prefill tokens a
    step (spread over several steps) and every decode gets its token in every step; with
    nothing decoding the prompt takes the whole budget. Outputs are exact."""
    cap = 6
    sched = Scheduler(BlockManager(64, BS, True), 8, 32, max_prefill_tokens_with_decodes=cap)
    decoders = [make_seq(3, max_tokens=12, first=k, request_id=f"d{k}") for k in range(2)]
    for s in decoders:
        sched.add(s)
    out, view = step(sched)  # both prompts (6 tokens) in one step: nothing decodes yet
    assert sum(n for _, _, n, _ in view) == 6
    long = make_seq(20, max_tokens=2, first=50, request_id="long")
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out, view = step(sched)
        check_step_invariants(sched, out, view)
        assert {seq.request_id for seq, *_ in view} >= {"d0", "d1"}  # no decode stalls
        prefill = [n for seq, _, n, _ in view if seq is long]
        assert sum(n for seq, _, n, _ in view if n > 1) <= cap
        chunks += prefill
    assert chunks == [6, 6, 6, 2] and sum(chunks) == 20
    lone = Scheduler(BlockManager(64, BS, True), 8, 32, max_prefill_tokens_with_decodes=cap)
    alone = make_seq(20, max_tokens=2, first=50, request_id="alone")
    lone.add(alone)
    _, view = step(lone)
    assert [n for _, _, n, _ in view] == [20]  # no decodes: the cap does not apply
    history = run_to_completion(sched, [])
    for s in (*decoders, long):
        assert s.is_finished and s.output_token_ids == expected_output(s)
    assert history is not None
