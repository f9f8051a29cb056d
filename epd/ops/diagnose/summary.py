"""``epd diagnose``'s per-pool summary of a window: rates, stage latencies, gauges, counters
and cache hit rates (:func:`summarize`)."""

from __future__ import annotations

from epd.metrics import (
    CANCELLED,
    DECODE_QUEUE,
    DECODE_STEP,
    E2E,
    EMBEDDING_TRANSFER,
    ENCODE,
    ENCODE_QUEUE,
    ENCODER_HITS,
    ENCODER_QUERIES,
    ITL,
    KV_BYTES,
    KV_FAILURES,
    KV_OPS,
    KV_RETRIES,
    KV_TRANSFER,
    KV_USAGE,
    MIGRATED,
    PREEMPTIONS,
    PREFILL,
    PREFILL_QUEUE,
    PREFIX_HITS,
    PREFIX_QUERIES,
    QUEUE_DEPTH,
    QUEUED_PROMPT_TOKENS,
    REQUEST_RETRIES,
    ROUTED,
    ROUTER_REQUESTS,
    RUNNING,
    TPOT,
    TTFT,
    TTS_FIRST_AUDIO,
    TTS_QUEUE,
    TTS_SYNTHESIS,
    WORKER_FAILURES,
)
from epd.ops.scrape import Scrape, Window

__all__ = ["STAGES", "summarize"]

#: stage histograms in report order: short name -> family
STAGES = {
    "ttft": TTFT, "tpot": TPOT, "itl": ITL, "e2e": E2E,
    "encode_queue": ENCODE_QUEUE, "encode": ENCODE, "embedding_transfer": EMBEDDING_TRANSFER,
    "prefill_queue": PREFILL_QUEUE, "prefill": PREFILL, "kv_transfer": KV_TRANSFER,
    "decode_queue": DECODE_QUEUE, "decode_step": DECODE_STEP,
    "tts_queue": TTS_QUEUE, "tts_first_audio": TTS_FIRST_AUDIO, "tts_synthesis": TTS_SYNTHESIS,
}


def summarize(w: Window) -> dict[str, dict]:
    """Per pool: instances, rates (per second), stages (:meth:`HistogramWindow.stats`), gauges
    (:meth:`Window.gauge_stats`), counters over the window, cache hit rates (0..1)."""
    out: dict[str, dict] = {}
    dur = w.duration_s
    for pool in w.pools():
        stages = {}
        for name, family in _stage_families(w.end).items():
            h = w.histogram(family, pool)
            if h is not None:
                stages[name] = h.stats(dur)
        rates: dict[str, float] = {}
        routed = w.counter(ROUTED, pool=pool)
        if routed:
            rates["routed_per_s"] = routed / dur
        if pool == "api":
            if "e2e" in stages:
                rates["requests_per_s"] = stages["e2e"]["count"] / dur
            rates["output_tokens_per_s"] = sum(stages[k]["count"] for k in ("ttft", "itl") if k in stages) / dur
        prompt = w.counter(PREFIX_QUERIES, pool=pool)
        if prompt:
            rates["prompt_tokens_per_s"] = prompt / dur
        nbytes = w.counter(KV_BYTES, pool=pool)
        if nbytes:
            rates["kv_bytes_per_s"] = nbytes / dur
        ops = w.counter(KV_OPS, pool=pool)
        if ops:  # NIXL operations, one per layer (and rank) of a transfer: not requests
            rates["kv_transfer_ops_per_s"] = ops / dur
            transfers = w.histogram(KV_TRANSFER, pool)
            if transfers is not None and transfers.count:
                rates["nixl_ops_per_transfer"] = ops / transfers.count
        step = w.histogram(DECODE_STEP, pool)
        if step is not None and step.count:  # fraction of the window an instance spent in steps, 0..1
            rates["decode_busy"] = min(1.0, step.sum / dur / max(1, w.instances(pool)))
        counters = {k: w.counter(name, pool=pool) for k, name in (
            ("preemptions", PREEMPTIONS), ("cancelled", CANCELLED), ("kv_transfer_failures", KV_FAILURES),
            ("kv_transfer_retries", KV_RETRIES), ("request_retries", REQUEST_RETRIES),
            ("migrated_requests", MIGRATED), ("worker_failures", WORKER_FAILURES))}
        caches = {}
        if prompt:
            caches["prefix_hit_rate"] = w.counter(PREFIX_HITS, pool=pool) / prompt  # hit tokens / looked-up tokens
            caches["prefix_query_tokens"] = prompt
            caches["prefix_hit_tokens"] = w.counter(PREFIX_HITS, pool=pool)
        items = w.counter(ENCODER_QUERIES, pool=pool)
        if items:
            caches["encoder_hit_rate"] = w.counter(ENCODER_HITS, pool=pool) / items
            caches["encoder_queries"] = items
        gauges = {k: g for k, name in (("kv_cache_usage", KV_USAGE), ("queue_depth", QUEUE_DEPTH),
                                       ("running", RUNNING), ("queued_prompt_tokens", QUEUED_PROMPT_TOKENS))
                  if (g := w.gauge_stats(name, pool)) is not None}
        if pool == "router":
            gauges["open_requests"] = {"last": w.end.total(ROUTER_REQUESTS)}
        out[pool] = {"instances": w.instances(pool) if pool not in ("api", "router") else None,
                     "rates": rates, "stages": stages, "gauges": gauges,
                     "counters": {k: v for k, v in counters.items() if v}, "caches": caches}
    return out


def _stage_families(s: Scrape) -> dict[str, str]:
    """Short stage name -> histogram family: :data:`STAGES` first, then any other epd_ histogram."""
    found = {n[: -len("_bucket")] for n in s.samples if n.startswith("epd_") and n.endswith("_bucket")}
    known = {name: fam for name, fam in STAGES.items() if fam in found}
    extra = {f.removeprefix("epd_").removesuffix("_seconds"): f for f in sorted(found - set(STAGES.values()))}
    return {**known, **extra}
