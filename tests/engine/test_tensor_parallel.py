"""TP=2 over two gloo processes gives the same greedy tokens as TP=1."""

from __future__ import annotations

import random

import pytest

from epd import LLM, SamplingParams
from epd.config import ConfigError
from epd.engine.kv_connector_base import StepKV


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_matches_tp1(kind, tiny_model_dirs):
    model_dir = tiny_model_dirs[kind]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 33, 70, 120)]
    params = SamplingParams(temperature=0, max_tokens=16)
    tp1 = LLM(model_dir, block_size=8, max_num_batched_tokens=32, dtype="float32")
    expected = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
    tp1.shutdown()
    tp2 = LLM(model_dir, block_size=8, max_num_batched_tokens=32, tensor_parallel_size=2, dtype="float32")
    try:
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, params)]
    finally:
        tp2.shutdown()
    assert got == expected
    assert all(not p.is_alive() for p in tp2.engine._procs)


def test_tp_must_divide_kv_heads(tiny_model_dirs):
    with pytest.raises(ConfigError, match="must divide"):
        LLM(tiny_model_dirs["llama"], tensor_parallel_size=3, dtype="float32")


@pytest.mark.slow
def test_tp2_with_image_embeddings(tmp_path):
    """Media embeddings reach every TP rank (broadcast beside the step message)."""
    import numpy as np
    from PIL import Image

    from epd.models.tiny import IMAGE_TOKEN, create_tiny_model

    model_dir = str(create_tiny_model("llava", tmp_path / "llava"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)) for _ in range(2)]
    request = {"prompt": f"Look {IMAGE_TOKEN}{IMAGE_TOKEN} and tell", "multi_modal_data": {"image": images}}
    params = SamplingParams(temperature=0, max_tokens=10)
    tp1 = LLM(model_dir, block_size=8, max_num_batched_tokens=16, dtype="float32")
    expected = tp1.generate(request, params)[0].outputs[0].token_ids
    tp1.shutdown()
    tp2 = LLM(model_dir, block_size=8, max_num_batched_tokens=16, tensor_parallel_size=2, dtype="float32")
    try:
        assert tp2.generate(request, params)[0].outputs[0].token_ids == expected
    finally:
        tp2.shutdown()


@pytest.mark.slow
def test_shutdown_after_interrupted_step_leaves_no_rank(tiny_model_dirs):
    """A step that dies mid-forward on rank 0 (Ctrl-C, a bug) leaves rank 1 waiting in a
    collective: shutdown must kill it rather than wait on a broadcast forever."""
    llm = LLM(tiny_model_dirs["llama"], tensor_parallel_size=2, dtype="float32")
    engine = llm.engine
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8))

    class Boom:  # a KV connector whose per-layer hook fails mid-forward
        def build_step(self, _sched):
            def hook(layer):
                if layer == 1:
                    raise RuntimeError("interrupted")
            return StepKV(hook)

        def request_finished(self, _seq):
            return False

    engine.kv_connector = Boom()
    with pytest.raises(RuntimeError, match="interrupted"):
        engine.step()
    procs = list(engine._procs)
    llm.shutdown()
    assert procs and not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_tp1_engine_after_interrupted_tp2_shutdown(tiny_model_dirs):
    """After an interrupted TP=2 engine is shut down, a TP=1 engine in the same process
    must not see the old process group."""
    import torch.distributed as dist

    test_shutdown_after_interrupted_step_leaves_no_rank(tiny_model_dirs)
    assert not dist.is_initialized()
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].finished
    llm.shutdown()


def test_gpu_staging_in_host_shared_memory_is_refused_naming_per_rank_agents(tiny_model_dirs):
    """On GPUs a staged (hetero-TP) transfer needs every rank's own VRAM staging pool; the
    rank0 mode's host shared-memory pool is refused before anything is allocated."""
    from epd.config import ConfigError, EngineConfig
    from epd.engine.llm_engine import LLMEngine

    config = EngineConfig(tiny_model_dirs["llama"], device="cuda", kv_cache_memory_gb=0.01)
    with pytest.raises(ConfigError, match="--kv-agents per-rank"):
        LLMEngine(config, kv_staging_blocks=4, kv_agents="rank0")
