"""What ``GET /epd/workers`` reports for an engine worker, without a server: the KV cache
dtype next to the block sizes (a string through the ``WorkerStats`` message), and the
prefix-cache counts named as the tokens they count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from epd.config import EngineConfig
from epd.messages import StatsRequest, WorkerStats, decode, encode
from epd.workers.engine_worker import EngineWorker


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny random llama (only that one: the session's tiny_model_dirs builds every kind)."""
    from epd.models.tiny import create_tiny_model

    return str(create_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0))


def _worker_stats(model_dir: str, **config) -> dict:
    cfg = EngineConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.01, **config)
    engine = SimpleNamespace(config=cfg, stats=lambda: {"num_blocks": 8, "prefix_cache_query_tokens": 32,
                                                        "prefix_cache_hit_tokens": 16})
    fake = SimpleNamespace(engine=engine, staging=None, kv_requests=lambda: 0,
                           fetcher=SimpleNamespace(stats=lambda: {}))
    return EngineWorker.stats(fake)


@pytest.mark.parametrize("kv_cache_dtype,expected", [("auto", "float32"), ("int8", "int8"), ("fp8", "fp8_e4m3")])
def test_worker_stats_name_the_kv_cache_dtype(llama, kv_cache_dtype, expected):
    s = _worker_stats(llama, kv_cache_dtype=kv_cache_dtype)
    assert s["kv_cache_dtype"] == expected
    assert s["kv_blocks_per_gb"] > 0
    # the router receives it as a string inside the stats message
    got = decode(encode(WorkerStats("prefill-0", 7, s)))
    assert isinstance(got, WorkerStats) and got.stats["kv_cache_dtype"] == expected
    assert got.stats["kv_blocks_per_gb"] == s["kv_blocks_per_gb"]
    assert not isinstance(decode(encode(StatsRequest(7))), WorkerStats)


@pytest.mark.parametrize("quantization,expected", [(None, "none"), ("int8", "int8")])
def test_worker_stats_and_ready_line_name_the_weight_quantization(llama, quantization, expected, capsys):
    """``quantization`` sits next to ``kv_cache_dtype`` in ``/epd/workers``, and the worker's
    ready line names int8 weights."""
    from epd.workers.base import BaseWorker

    s = _worker_stats(llama, quantization=quantization)
    assert s["quantization"] == expected
    got = decode(encode(WorkerStats("pd-0", 7, s)))
    assert got.stats["quantization"] == expected
    cfg = EngineConfig(llama, dtype="float32", kv_cache_memory_gb=0.01, quantization=quantization)
    sent = []
    fake = SimpleNamespace(_last_ready_sent=0.0, engine=SimpleNamespace(config=cfg, runner=SimpleNamespace(
        num_blocks=8)), instance_id="pd-0", role="pd", cmd_endpoint="tcp://127.0.0.1:1",
        args=SimpleNamespace(keys=None, router="tcp://127.0.0.1:2"), send=sent.append, _ready_msg="ready")
    BaseWorker._send_ready(fake)
    line = capsys.readouterr().out
    assert sent == ["ready"] and "(pd, float32" in line
    assert ("float32, int8 weights, KV cache float32" in line) == (quantization == "int8"), line


def test_quantized_kv_has_more_blocks_per_gb(llama):
    full = _worker_stats(llama)
    q = _worker_stats(llama, kv_cache_dtype="int8")
    assert q["kv_blocks_per_gb"] > full["kv_blocks_per_gb"]


def test_engine_stats_name_the_prefix_cache_counts_as_tokens():
    # the block manager counts tokens (tests/engine/test_block_manager.py); the stats say so
    from epd.engine.llm_engine import LLMEngine

    bm = SimpleNamespace(num_blocks=8, num_free_blocks=6, usage=lambda: 0.25, prefix_cache_queries=40,
                         prefix_cache_hits=16, prefix_cache_host_hits=8, prefix_cache_disk_hits=0,
                         prefix_cache_remote_hits=0,
                         host_tier=None)
    sched = SimpleNamespace(running=[], waiting=[], waiting_for_remote_kv={}, num_preemptions=0)
    s = LLMEngine.stats(SimpleNamespace(block_manager=bm, scheduler=sched, config=SimpleNamespace(max_model_len=64),
                                        spec=None))
    assert "prefix_cache_queries" not in s and "prefix_cache_hits" not in s
    assert (s["prefix_cache_query_tokens"], s["prefix_cache_hit_tokens"]) == (40, 16)
    assert s["prefix_cache_host_hit_tokens"] == 8 and "kv_host_blocks" not in s  # no host tier: no kv_host_* counts


def test_heartbeat_metrics_read_the_token_counts():
    from unittest.mock import MagicMock

    from epd.workers.engine_metrics import record_engine_stats

    counted = {}
    fake = SimpleNamespace(metrics=MagicMock(), labels={}, _counted={},
                           count_total=lambda name, total: counted.__setitem__(name, total))
    record_engine_stats(fake, {"num_blocks": 8, "prefix_cache_query_tokens": 40, "prefix_cache_hit_tokens": 16})
    assert counted["prefix_cache_queries_tokens"] == 40
    fake.metrics.prefix_cache_hits_tokens.labels.assert_called_once_with(tier="device")
    fake.metrics.prefix_cache_hits_tokens.labels.return_value.inc.assert_called_once_with(16)


def test_hit_tokens_are_counted_by_tier_and_never_go_down():
    from prometheus_client import CollectorRegistry, Counter

    from epd.workers.engine_metrics import count_hits_by_tier

    registry = CollectorRegistry()
    hits = Counter("hits", "h", ("pool", "instance", "tier"), registry=registry)
    fake = SimpleNamespace(metrics=SimpleNamespace(prefix_cache_hits_tokens=hits),
                           labels={"pool": "prefill", "instance": "prefill-0"}, _counted={})

    def value(tier):
        return registry.get_sample_value("hits_total", {"pool": "prefill", "instance": "prefill-0", "tier": tier})

    for total, host, disk in ((16, 0, 0), (48, 24, 8), (48, 32, 8), (64, 32, 8)):  # a load before its admission
        count_hits_by_tier(fake, {"prefix_cache_hit_tokens": total, "prefix_cache_host_hit_tokens": host,
                                  "prefix_cache_disk_hit_tokens": disk})
    assert (value("device"), value("host"), value("disk")) == (32, 24, 8)
