"""Stall-free batching bounded in time: the online step-time model recovers a known cost,
its prefill budget is the largest chunk under the target, and the scheduler spreads a
long prompt over steps of that size while sequences decode (and only then)."""

from __future__ import annotations

import numpy as np

from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler
from epd.engine.step_time import StepTimeModel, step_features
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

# A known cost: 10 ms + 1 ms a decode + 0.02 ms per 1k context tokens + 0.5 ms a prompt
# token + 2 ms per 1M (chunk tokens x chunk context).
TRUE = np.array([10.0, 1.0, 0.02, 0.5, 2.0])


def _cost(decodes, context, chunks):
    return float(step_features(decodes, context, chunks) @ TRUE)


def test_the_model_recovers_a_linear_cost_and_budgets_under_the_target():
    rng = np.random.default_rng(0)
    model = StepTimeModel(window=128, refit_every=8)
    assert model.prefill_budget(50.0, 4, 400, 0, 16, 512) is None  # nothing seen yet
    for _ in range(128):
        d = int(rng.integers(0, 33))
        n = int(rng.integers(0, 300)) if rng.random() < 0.6 else 0
        ctx = int(rng.integers(0, 2000))
        chunks = [(n, ctx + n)] if n else []
        f = step_features(d, d * 300, chunks)
        stalled = 40.0 if rng.random() < 0.05 else 1.0  # a step the OS preempted now and then
        model.observe(f, _cost(d, d * 300, chunks) * float(rng.uniform(0.97, 1.03)) * stalled)
    f = step_features(8, 2400, [(100, 600)])
    assert abs(model.predict(f) - _cost(8, 2400, [(100, 600)])) < 0.05 * _cost(8, 2400, [(100, 600)])
    # The budget is the largest chunk whose predicted step stays under the target.
    n = model.prefill_budget(60.0, 8, 2400, 500, 16, 1024)
    assert model.predict(step_features(8, 2400, [(n, 500 + n)])) <= 60.0
    assert model.predict(step_features(8, 2400, [(n + 1, 501 + n)])) > 60.0
    assert 70 <= n <= 85  # (60 - 18) / 0.5 = 84 minus the attention term
    assert model.prefill_budget(1000.0, 8, 2400, 500, 16, 256) == 256  # the token cap still holds
    assert model.prefill_budget(5.0, 32, 9600, 0, 16, 256) == 16  # decodes alone exceed it: one block


def test_a_long_prompt_is_spread_over_steps_that_fit_the_target():
    bs = 16
    sched = Scheduler(BlockManager(512, bs, False), 16, 2048, 1024, target_step_ms=60.0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(8):
        sched.add(Sequence(f"d{i}", [1 + i] * 300, params))
    out = sched.schedule()  # no decodes yet: the whole budget is open to prefill
    assert out.num_tokens == 2048
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running) or sched.waiting:
        sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled if s.sample})
        out = sched.schedule()
    sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled if s.sample})
    # Steps of 1-16 decodes with prompt chunks of varied sizes teach the model the cost.
    rng = np.random.default_rng(1)
    for _ in range(64):
        d, n = int(rng.integers(1, 17)), int(rng.integers(0, 400))
        chunks = [(n, 300 + n)] if n else []
        sched.step_time.observe(step_features(d, 300 * d, chunks), _cost(d, 300 * d, chunks))
    long = Sequence("long", [7] * 1500, params)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        mine = [s for s in out.scheduled if s.seq is long]
        decodes = [s for s in out.scheduled if s.num_tokens == 1 and s.seq is not long]
        assert len(decodes) == 8  # every decoding stream still gets its token
        chunks.append(mine[0].num_tokens)
        step_ms = _cost(len(decodes), sum(s.start + 1 for s in decodes),
                        [(mine[0].num_tokens, mine[0].start + mine[0].num_tokens)])
        assert step_ms <= 60.0 * 1.05 or mine[0].num_tokens == bs
        sched.observe(out, step_ms)
        sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled if s.sample})
    assert len(chunks) > 10 and max(chunks) < 1024  # spread out: never the token cap's 1,024
    assert sum(chunks) == 1500


def test_without_the_target_only_the_token_cap_applies():
    sched = Scheduler(BlockManager(512, 16, False), 16, 2048, 256)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    sched.add(Sequence("a", [3] * 20, params))
    out = sched.schedule()
    sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled if s.sample})
    for _ in range(5):
        sched.observe(out, 1e6)  # ignored without a target
    sched.add(Sequence("b", [4] * 1000, params))
    out = sched.schedule()
    assert sorted(s.num_tokens for s in out.scheduled) == [1, 256]


def test_the_engine_times_its_steps_and_spreads_prompts_with_the_same_tokens(tiny_model_dirs):
    """A real engine feeds its steps' wall times to the model; under a target no step can
    meet, once fitted, every prompt that arrives while others decode goes one block a
    step, and the greedy tokens equal those of an engine without the target."""
    from epd import LLM

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[5 + i, 9, 11, 7] * (3 + 5 * i) for i in range(8)]
    outs, big_mixed = {}, {}
    for target in (0.0, 1e-3):
        llm = LLM(tiny_model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=512,
                  max_prefill_tokens_with_decodes=0, target_step_ms=target, enable_prefix_caching=False)
        eng = llm.engine
        schedule, fitted_steps = eng.scheduler.schedule, []

        def traced():
            out = schedule()
            fitted_steps.append((eng.scheduler.step_time.coef is not None, out))
            return out

        eng.scheduler.schedule = traced
        try:
            eng.add_request("r0", prompts[0], params)
            done, k, steps = {}, 1, 0
            while eng.has_unfinished_requests():
                if k < len(prompts) and eng.scheduler.running and steps % 3 == 0:
                    eng.add_request(f"r{k}", prompts[k], params)
                    k += 1
                seen = eng.scheduler.step_time._n
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
                steps += 1
                assert eng.scheduler.step_time._n == seen + (1 if target else 0)  # timed only with a target
            outs[target] = [done[f"r{i}"] for i in range(len(prompts))]
            big_mixed[target] = sum(
                1 for fitted, out in fitted_steps if fitted or not target
                if any(s.num_tokens == 1 for s in out.scheduled) and any(s.num_tokens > 8 for s in out.scheduled))
            assert (eng.scheduler.step_time.coef is not None) == bool(target)
        finally:
            llm.shutdown()
    assert outs[1e-3] == outs[0.0]
    assert big_mixed[0.0] > 0 and big_mixed[1e-3] == 0
