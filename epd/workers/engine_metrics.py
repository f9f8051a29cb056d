"""An engine worker's metrics from its engine's stats (``LLMEngine.stats``), once per
heartbeat: KV cache and queue gauges, preemptions, prefix-cache lookups and hits by tier,
and the host and disk tiers' block counts. Counters advance to the engine's running
totals (``BaseWorker.count_total``)."""

from __future__ import annotations

__all__ = ["count_hits_by_tier", "record_engine_stats"]


def count_hits_by_tier(worker, stats: dict[str, float]) -> None:
    """``epd_prefix_cache_hits_tokens_total{tier}`` from the engine's running totals: of the
    hit tokens, those loaded from the host tier (``prefix_cache_host_hit_tokens``), of which
    those its disk tier read back (``prefix_cache_disk_hit_tokens``), and those read from
    another instance's KV cache (``prefix_cache_remote_hit_tokens``, counted when read);
    the rest were on the device. A tier's count only moves up (a load is counted when it happens, its request's
    hits when the request is admitted, so the device share can lag a heartbeat).

    ``worker``: has ``metrics``, ``labels`` and ``_counted`` (totals already counted)."""
    total = stats.get("prefix_cache_hit_tokens", 0)
    host = stats.get("prefix_cache_host_hit_tokens", 0)
    disk = stats.get("prefix_cache_disk_hit_tokens", 0)
    remote = stats.get("prefix_cache_remote_hit_tokens", 0)
    for tier, value in (("device", total - host - remote), ("host", host - disk), ("disk", disk),
                        ("remote", remote)):
        key = f"prefix_cache_hits_tokens/{tier}"
        seen = worker._counted.get(key, 0.0)
        if value > seen:
            worker.metrics.prefix_cache_hits_tokens.labels(**worker.labels, tier=tier).inc(value - seen)
            worker._counted[key] = value


def record_engine_stats(worker, stats: dict[str, float]) -> None:
    """Set the engine gauges and advance the engine counters of ``worker`` (a
    ``BaseWorker``) from ``stats``; nothing when ``stats`` has no KV cache (``num_blocks``)."""
    if "num_blocks" not in stats:
        return
    m, labels = worker.metrics, worker.labels
    m.kv_cache_usage_ratio.labels(**labels).set(stats.get("kv_cache_usage", 0.0))
    m.queue_depth.labels(**labels).set(stats.get("num_waiting", 0))
    m.running_requests.labels(**labels).set(stats.get("num_running", 0))
    m.queued_prompt_tokens.labels(**labels).set(stats.get("num_queued_prompt_tokens", 0))
    worker.count_total("preemptions", stats.get("num_preemptions", 0))
    worker.count_total("prefix_cache_queries_tokens", stats.get("prefix_cache_query_tokens", 0))
    count_hits_by_tier(worker, stats)
    if "kv_host_blocks" in stats:  # the host tier (--kv-host-cache-gb)
        for name in ("offloaded", "loaded", "evicted"):
            worker.count_total(f"kv_host_{name}_blocks", stats[f"kv_host_{name}_blocks"])
        m.kv_host_cache_usage_ratio.labels(**labels).set(stats["kv_host_used_blocks"] / stats["kv_host_blocks"])
    if "kv_disk_blocks" in stats:  # the disk tier under it (--kv-disk-cache-dir)
        for name in ("stored", "loaded", "evicted"):
            worker.count_total(f"kv_disk_{name}_blocks", stats[f"kv_disk_{name}_blocks"])
        worker.count_total("kv_disk_write_errors", stats["kv_disk_write_errors"])
        m.kv_disk_cache_usage_ratio.labels(**labels).set(stats["kv_disk_used_blocks"] / stats["kv_disk_blocks"])
    if "spec_num_drafts" in stats:  # speculative decoding (--speculative-config)
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            worker.count_total(f"spec_decode_num_{name}", stats[f"spec_num_{name}"])
        pos = 0
        while f"spec_num_accepted_tokens_pos{pos}" in stats:
            key, value = f"spec_pos/{pos}", stats[f"spec_num_accepted_tokens_pos{pos}"]
            if value > worker._counted.get(key, 0.0):
                m.spec_decode_num_accepted_tokens_per_pos.labels(**labels, position=str(pos)).inc(
                    value - worker._counted.get(key, 0.0))
                worker._counted[key] = value
            pos += 1
    if "remote_prefix_read_blocks" in stats:  # a prefill worker's remote prefix reads
        for outcome in ("ok", "fallback", "aborted"):
            key = f"remote_prefix_reads/{outcome}"
            value, seen = stats[f"remote_prefix_reads_{outcome}"], worker._counted.get(key)
            if seen is None or value > seen:
                m.remote_prefix_reads.labels(**labels, outcome=outcome).inc(value - (seen or 0))
                worker._counted[key] = value
        worker.count_total("remote_prefix_read_bytes", stats["remote_prefix_read_bytes"])
        m.kv_pinned_blocks.labels(**labels).set(stats["num_pinned_blocks"])
