"""CUDA-graph decode: capture sizes, padding to the next size, and the padded step.

Without a GPU the padded step runs eagerly from the persistent buffers (what a graph
replays), so the padding logic is checked here: the real rows' logits equal the eager
step's, padding rows write no KV, and ineligible steps are left to the eager path.
"""

from __future__ import annotations

import pytest
import torch

from epd import LLM, SamplingParams
from epd.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from epd.engine.step_input import step_layout


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # vLLM's default, up to max_num_seqs
    assert capture_sizes(3) == [1, 2]
    assert capture_sizes(16, [8, 2, 2, 32]) == [2, 8]
    with pytest.raises(ValueError):
        capture_sizes(8, [0, 4])
    sizes = [1, 2, 4, 8]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_padded_decode_step_matches_eager(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=8, dtype="float32", max_num_seqs=8)
    eng = llm.engine
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i in range(3):
            eng.add_request(f"r{i}", [5 + i, 9, 11 + 2 * i, 7] * (2 + i), params)
        eng.step()  # the three prompts
        sched = eng.scheduler.schedule()
        step, mm = eng.input_batch.build(sched, eng.scheduler.running)
        runner = eng.runner
        eager = runner._run(step)  # stores the step's K/V, returns logits [3, vocab]
        lay = step_layout(step, runner.tables, 8)
        assert lay.num_decode_tokens == 3 and not lay.prefills and mm is None
        k_before = runner.k_cache.clone()
        used = {b for b in lay.decode_block_tables.flatten().tolist() if b >= 0}
        graphs = DecodeGraphs(runner.model, [1, 2, 4, 8], max_blocks=16, device=runner.device, capture=False)
        assert graphs.eligible(lay, step)
        assert graphs.load(lay) == 4  # 3 sequences: padded to 4
        assert graphs.slot_mapping[3] == -1 and graphs.context_lens[3] == 0 and graphs.input_ids[3] == 0
        padded = runner._logits(step, graphs.run(lay))
        torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))
        untouched = [b for b in range(runner.k_cache.shape[1]) if b not in used]
        assert torch.equal(runner.k_cache[:, untouched], k_before[:, untouched])  # padding wrote no KV
        # A step with a prefill chunk, or more sequences than the largest size, runs eagerly.
        assert not DecodeGraphs(runner.model, [1, 2], 16, runner.device, capture=False).eligible(lay, step)
        eng.add_request("late", list(range(3, 20)), params)
        mixed, _ = eng.input_batch.build(eng.scheduler.schedule(), eng.scheduler.running)
        runner.tables.apply(mixed.table_update)
        mixed_lay = step_layout(mixed, runner.tables, 8)
        assert mixed_lay.prefills and not graphs.eligible(mixed_lay, mixed)
    finally:
        llm.shutdown()


def test_graphs_only_where_they_apply(tiny_model_dirs):
    from epd.config import EngineConfig

    d = tiny_model_dirs["llama"]
    assert EngineConfig(d, device="cpu").graph_sizes() == []  # CPU: eager
    if torch.cuda.is_available():
        assert EngineConfig(d, device="cuda", max_num_seqs=16).graph_sizes() == [1, 2, 4, 8, 16]
        assert EngineConfig(d, device="cuda", enforce_eager=True).graph_sizes() == []
        assert EngineConfig(d, device="cuda", cuda_graph_sizes=(4, 2)).graph_sizes() == [2, 4]


@pytest.mark.slow
def test_compile_keeps_greedy_parity(tiny_model_dirs):
    """``compile=True`` (torch.compile, dynamic shapes) gives the eager engine's greedy tokens."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 40 + i, 8, 2]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for compiled in (False, True):
        llm = LLM(tiny_model_dirs["llama"], dtype="float32", compile=compiled)
        try:
            outs[compiled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]
