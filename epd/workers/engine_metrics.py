"""An engine worker's metrics from its engine's stats (``LLMEngine.stats``), once per
heartbeat: KV cache and queue gauges, preemptions, prefix-cache lookups and hits by tier,
and the host and disk tiers' block counts. Counters advance to the engine's running
totals (``BaseWorker.count_total``)."""

from __future__ import annotations

__all__ = ["advance_labelled", "count_hits_by_tier", "record_engine_stats"]


def advance_labelled(worker, name: str, total: float, *, create: bool = False, **label: str) -> None:
    """Advance the labelled counter ``name`` of ``worker.metrics`` (its series ``label``) to
    a running ``total`` kept elsewhere: only ever up. ``create``: the series exists from the
    first call, at 0 until the total moves. ``worker``: has ``metrics``, ``labels`` and
    ``_counted`` (totals already counted, by name and label)."""
    key = f"{name}/{'/'.join(label.values())}"
    seen = worker._counted.get(key)
    if total > (seen or 0.0) or (create and seen is None):
        getattr(worker.metrics, name).labels(**worker.labels, **label).inc(total - (seen or 0.0))
        worker._counted[key] = total


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
        advance_labelled(worker, "prefix_cache_hits_tokens", value, tier=tier)


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
            advance_labelled(worker, "spec_decode_num_accepted_tokens_per_pos",
                             stats[f"spec_num_accepted_tokens_pos{pos}"], position=str(pos))
            pos += 1
    if "remote_prefix_read_blocks" in stats:  # a prefill worker's remote prefix reads
        for outcome in ("ok", "fallback", "aborted"):  # (each series exists from the first report, at 0)
            advance_labelled(worker, "remote_prefix_reads", stats[f"remote_prefix_reads_{outcome}"], create=True,
                             outcome=outcome)
        worker.count_total("remote_prefix_read_bytes", stats["remote_prefix_read_bytes"])
        m.kv_pinned_blocks.labels(**labels).set(stats["num_pinned_blocks"])
