"""The symptom checks of ``epd diagnose``: each reads a :class:`~epd.ops.scrape.Window` and
returns :class:`~epd.ops.diagnose.symptoms.Check` s (a symptom, ok, not applicable or not
evaluated); :func:`evaluate` runs them all. Their thresholds are in
:mod:`epd.ops.diagnose.thresholds`."""

from __future__ import annotations

import math

from epd.metrics import (
    CANCELLED,
    DECODE_QUEUE,
    DECODE_STEP,
    E2E,
    ITL,
    KV_BYTES,
    KV_DISK_EVICTED,
    KV_DISK_STORED,
    KV_FAILURES,
    KV_HOST_EVICTED,
    KV_OPS,
    KV_RETRIES,
    KV_TRANSFER,
    KV_USAGE,
    PREEMPTIONS,
    PREFILL,
    PREFILL_QUEUE,
    PREFIX_HITS,
    PREFIX_QUERIES,
    QUEUE_DEPTH,
    ROUTED,
    ROUTER_REQUESTS,
    RUNNING,
    TPOT,
    TTFT,
)
from epd.ops.diagnose.format import byte_size, ms, percent
from epd.ops.diagnose.symptoms import Check, Settings
from epd.ops.diagnose.thresholds import (
    DECODE_QUEUE_HIGH_S,
    DECODE_WAITING_MIN,
    GOODPUT_MIN_FRACTION,
    KV_TRANSFER_OVER_PREFILL,
    KV_TRANSFER_P99_S,
    KV_USAGE_HIGH,
    MIN_REQUESTS,
    MIN_STEPS,
    POOL_IDLE_MAX,
    PREEMPTION_FRACTION,
    PREEMPTIONS_MIN,
    PREFILL_CONCURRENCY_MIN,
    PREFILL_QUEUE_MIN_S,
    PREFIX_HIT_RATE_MIN,
    PREFIX_MIN_QUERY_TOKENS,
    QUEUE_DOMINANCE_RATIO,
    QUEUE_SHARE_OF_TTFT,
    SPIKE_MIN_COUNT,
    SPIKE_MIN_S,
    SPIKE_RATIO,
    SPIKE_TIME_SHARE,
)
from epd.ops.scrape import ENGINE_POOLS, HistogramWindow, Window, delta

__all__ = ["CHECKS", "evaluate"]


def _too_few(family: str, h: HistogramWindow | None, need: int, pool: str) -> str | None:
    """Why ``h`` cannot be judged (missing or fewer than ``need`` observations), else None."""
    if h is None:
        return f"{family} has no series in pool {pool}"
    if h.count < need:
        return f"{family}{{pool={pool}}}: {h.count:.0f} observations in the window, need {need}"
    return None




def _spikes(h: HistogramWindow) -> tuple[float, float, float]:
    """(threshold s, observations above it, their estimated total s) of ``h``: threshold =
    max(SPIKE_MIN_S, SPIKE_RATIO x p50); each observation above it counts as its bucket's
    middle (the +Inf bucket's as its lower edge), the part of a bucket above the threshold
    in proportion."""
    threshold = max(SPIKE_MIN_S, SPIKE_RATIO * h.quantile(0.5))
    count = total = lower = below = 0.0
    for bound, cum in zip(h.bounds, h.cumulative):
        n = cum - below
        if n > 0 and bound > threshold:
            if math.isinf(bound):
                count, total = count + n, total + n * max(lower, threshold)
            else:
                lo = max(lower, threshold)
                part = n * (bound - lo) / (bound - lower)
                count, total = count + part, total + part * (lo + bound) / 2
        lower, below = (lower if math.isinf(bound) else bound), cum
    return threshold, count, total


def _itl_spiky(h: HistogramWindow) -> bool:
    _, n, t = _spikes(h)
    return n >= SPIKE_MIN_COUNT and t >= SPIKE_TIME_SHARE * h.sum


def _step_spiky(h: HistogramWindow) -> bool:
    return _spikes(h)[1] >= SPIKE_MIN_COUNT


def _spike_words(h: HistogramWindow, what: str) -> str:
    threshold, n, t = _spikes(h)
    share = f", {t / h.sum:.0%} of their time" if h.sum > 0 else ""
    return f"{n:.0f} of {h.count:.0f} {what} over {ms(threshold)} (p50 {ms(h.quantile(0.5))}){share}"


def check_prefill_steals_decode(w: Window, s: Settings) -> list[Check]:
    """Aggregated pool: ITL spikes (gaps over max(SPIKE_MIN_S, SPIKE_RATIO x p50): at least
    SPIKE_MIN_COUNT of them, holding SPIKE_TIME_SHARE of the ITL time) and pd decode steps as
    long (at least SPIKE_MIN_COUNT): some steps carry prefill chunks and stall every stream."""
    cid = "prefill_steals_decode"
    if not w.has_pool("pd"):
        return [Check(cid, "not_applicable", detail="no aggregated (pd) pool")]
    itl, step = w.histogram(ITL, "api"), w.histogram(DECODE_STEP, "pd")
    why = _too_few(ITL, itl, MIN_STEPS, "api") or _too_few(DECODE_STEP, step, MIN_STEPS, "pd")
    if why:
        return [Check(cid, "not_evaluated", "pd", why)]
    threshold, n, t = _spikes(itl)
    ev = {"itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99), "itl_spikes": n,
          "itl_spike_threshold_s": threshold, "itl_spike_time_share": t / itl.sum if itl.sum else 0.0,
          "step_p50_s": step.quantile(0.5), "step_p99_s": step.quantile(0.99), "step_spikes": _spikes(step)[1]}
    routed = w.counter(ROUTED, pool="pd")
    if routed:
        ev["prompt_tokens_per_request"] = w.counter(PREFIX_QUERIES, pool="pd") / routed
    detail = f"{_spike_words(itl, 'ITL gaps')}; {_spike_words(step, 'pd decode steps')}"
    fired = _itl_spiky(itl) and _step_spiky(step)
    return [Check(cid, "symptom" if fired else "ok", "pd", detail, ev)]


def check_prefill_queue(w: Window, s: Settings) -> list[Check]:
    """Prefill pool: queue mean >= QUEUE_DOMINANCE_RATIO x execution mean, >= PREFILL_QUEUE_MIN_S
    and >= QUEUE_SHARE_OF_TTFT x TTFT mean. Then ``prefill_budget_small`` when the instances
    prefill fewer than PREFILL_CONCURRENCY_MIN requests at once (execution seconds / window /
    instances), else ``prefill_queue_dominates_ttft``."""
    ids = ("prefill_queue_dominates_ttft", "prefill_budget_small")
    if not w.has_pool("prefill"):
        return [Check(i, "not_applicable", detail="no prefill pool (an aggregated pool exports no prefill queue)")
                for i in ids]
    q, x, ttft = w.histogram(PREFILL_QUEUE, "prefill"), w.histogram(PREFILL, "prefill"), w.histogram(TTFT, "api")
    why = (_too_few(PREFILL_QUEUE, q, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
           or _too_few(TTFT, ttft, MIN_REQUESTS, "api"))
    if why:
        return [Check(i, "not_evaluated", "prefill", why) for i in ids]
    n = max(1, w.instances("prefill"))
    concurrency = x.sum / w.duration_s / n
    ev = {"queue_mean_s": q.mean, "queue_p95_s": q.quantile(0.95), "prefill_mean_s": x.mean,
          "ttft_mean_s": ttft.mean, "ttft_p95_s": ttft.quantile(0.95), "instances": n,
          "prefilling_per_instance": concurrency}
    tpot = w.histogram(TPOT, "api")
    if tpot is not None and tpot.count:
        ev["tpot_p95_s"] = tpot.quantile(0.95)
    routed = w.counter(ROUTED, pool="prefill")
    if routed:
        ev["prompt_tokens_per_request"] = w.counter(PREFIX_QUERIES, pool="prefill") / routed
    detail = (f"prefill queue mean {ms(q.mean)} vs prefill execution mean {ms(x.mean)}, TTFT mean "
              f"{ms(ttft.mean)}; {concurrency:.2f} requests in prefill at once per instance ({n} instance(s))")
    dominated = (q.mean >= QUEUE_DOMINANCE_RATIO * x.mean and q.mean >= PREFILL_QUEUE_MIN_S
                 and q.mean >= QUEUE_SHARE_OF_TTFT * ttft.mean)
    under_used = concurrency < PREFILL_CONCURRENCY_MIN
    if dominated and not under_used:
        detail += f"; try --pools p:{n + 1},..."
    if dominated and under_used and concurrency < 0.5:
        detail += (" (the engine computes less than half the time: requests may also wait for KV staging room "
                   "or decode reservations)")
    return [Check(ids[0], "symptom" if dominated and not under_used else "ok", "prefill", detail, ev),
            Check(ids[1], "symptom" if dominated and under_used else "ok", "prefill", detail, dict(ev))]


def check_decode_tpot_jitter(w: Window, s: Settings) -> list[Check]:
    """Decode pool: ITL spikes (as in ``prefill_steals_decode``) while TTFT p95 <= the TTFT SLO,
    and decode steps vary (at least SPIKE_MIN_COUNT spiky steps, or step p95 above the TPOT
    SLO) or the KV cache is nearly full (max usage >= KV_USAGE_HIGH)."""
    cid = "decode_tpot_jitter"
    if not w.has_pool("decode"):
        return [Check(cid, "not_applicable", detail="no decode pool (aggregated pools: prefill_steals_decode)")]
    itl, step, ttft = w.histogram(ITL, "api"), w.histogram(DECODE_STEP, "decode"), w.histogram(TTFT, "api")
    why = (_too_few(ITL, itl, MIN_STEPS, "api") or _too_few(DECODE_STEP, step, MIN_STEPS, "decode")
           or _too_few(TTFT, ttft, MIN_REQUESTS, "api"))
    if why:
        return [Check(cid, "not_evaluated", "decode", why)]
    kv = w.gauge_stats(KV_USAGE, "decode")
    ev = {"itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99), "itl_spikes": _spikes(itl)[1],
          "step_p50_s": step.quantile(0.5), "step_p95_s": step.quantile(0.95), "step_p99_s": step.quantile(0.99),
          "step_spikes": _spikes(step)[1], "ttft_p95_s": ttft.quantile(0.95), "ttft_slo_s": s.ttft_slo_s}
    if kv is not None:
        ev["kv_usage_max"] = kv["max"]
    detail = (f"{_spike_words(itl, 'ITL gaps')}; {_spike_words(step, 'decode steps')}, p95 "
              f"{ms(ev['step_p95_s'])}; TTFT p95 {ms(ev['ttft_p95_s'])}"
              + (f"; KV usage max {percent(kv['max'])}" if kv else ""))
    jitter = _itl_spiky(itl)
    ttft_fine = ev["ttft_p95_s"] <= s.ttft_slo_s
    step_cause = _step_spiky(step) or ev["step_p95_s"] > s.tpot_slo_s
    kv_cause = kv is not None and kv["max"] >= KV_USAGE_HIGH
    fired = jitter and ttft_fine and (step_cause or kv_cause)
    if jitter and not ttft_fine:
        detail += " (TTFT is high too: see the prefill checks)"
    elif jitter and not fired:
        detail += " (not explained by decode steps or KV usage: look at the API host and the network)"
    return [Check(cid, "symptom" if fired else "ok", "decode", detail, ev)]


def check_kv_transfer(w: Window, s: Settings) -> list[Check]:
    """Prefill pool: KV transfers failed or were retried in the window; or KV transfer p99 >=
    KV_TRANSFER_P99_S and >= KV_TRANSFER_OVER_PREFILL x prefill execution p99."""
    cid = "kv_transfer_slow"
    if not w.has_pool("prefill"):
        return [Check(cid, "not_applicable", detail="no prefill pool: no P->D transfer")]
    failures, retries = w.counter(KV_FAILURES), w.counter(KV_RETRIES)
    kt, x = w.histogram(KV_TRANSFER, "prefill"), w.histogram(PREFILL, "prefill")
    ev: dict[str, float | str] = {"failures": failures, "retries": retries}
    if failures or retries:
        return [Check(cid, "symptom", "prefill", f"{failures:.0f} KV transfers failed, {retries:.0f} retried "
                      "in the window", ev)]
    why = _too_few(KV_TRANSFER, kt, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
    if why:
        return [Check(cid, "not_evaluated", "prefill", why, ev)]
    nbytes = w.counter(KV_BYTES, pool="prefill")
    ev.update({"p50_s": kt.quantile(0.5), "p99_s": kt.quantile(0.99), "prefill_p99_s": x.quantile(0.99),
               "bytes_per_request": nbytes / kt.count})
    if ops := w.counter(KV_OPS, pool="prefill"):
        ev["nixl_ops_per_transfer"] = ops / kt.count  # layers (x TP ranks with per-rank agents)
    if kt.sum > 0:
        ev["effective_gb_per_s"] = nbytes / kt.sum / 1e9  # a lower bound: the time overlaps compute
    fired = ev["p99_s"] >= KV_TRANSFER_P99_S and ev["p99_s"] >= KV_TRANSFER_OVER_PREFILL * ev["prefill_p99_s"]
    detail = (f"KV transfer p50/p99 {ms(ev['p50_s'])}/{ms(ev['p99_s'])} vs prefill execution p99 "
              f"{ms(ev['prefill_p99_s'])}; {byte_size(ev['bytes_per_request'])} per request")
    return [Check(cid, "symptom" if fired else "ok", "prefill", detail, ev)]


def _decode_kv_evidence(w: Window, pool: str) -> tuple[bool, str | None, str, dict]:
    """(short, why-not-evaluated, detail, evidence) of the KV-shortage test of ``pool``."""
    preempt, routed = w.counter(PREEMPTIONS, pool=pool), w.counter(ROUTED, pool=pool)
    kv, waiting = w.gauge_stats(KV_USAGE, pool), w.gauge_stats(QUEUE_DEPTH, pool)
    dq = w.histogram(DECODE_QUEUE, pool) if pool == "decode" else None
    ev: dict[str, float | str] = {"preemptions": preempt, "requests": routed}
    parts = [f"{preempt:.0f} preemptions in {routed:.0f} requests"]
    preempted = preempt >= max(PREEMPTIONS_MIN, PREEMPTION_FRACTION * routed)
    queued = False
    if dq is not None and dq.count >= MIN_REQUESTS:
        ev["decode_queue_p95_s"] = dq.quantile(0.95)
        parts.append(f"decode queue p95 {ms(ev['decode_queue_p95_s'])}")
        queued = ev["decode_queue_p95_s"] >= DECODE_QUEUE_HIGH_S
    full = False
    if kv is not None:
        ev["kv_usage_mean"], ev["kv_usage_max"] = kv["mean"], kv["max"]
        parts.append(f"KV usage mean/max {percent(kv['mean'])}/{percent(kv['max'])}")
        if waiting is not None:
            per_instance = waiting["mean_total"] / max(1, w.instances(pool))
            ev["waiting_per_instance_mean"] = per_instance
            parts.append(f"{per_instance:.1f} waiting per instance")
            full = kv["max"] >= KV_USAGE_HIGH and per_instance >= DECODE_WAITING_MIN
    short = preempted or queued or full
    why = None
    if not short and routed < MIN_REQUESTS and (dq is None or dq.count < MIN_REQUESTS):
        why = f"{routed:.0f} requests routed to pool {pool} in the window, need {MIN_REQUESTS}"
    return short, why, "; ".join(parts), ev


def check_decode_kv_short(w: Window, s: Settings) -> list[Check]:
    """Decode and pd pools: preemptions >= max(PREEMPTIONS_MIN, PREEMPTION_FRACTION x requests),
    or decode queue p95 >= DECODE_QUEUE_HIGH_S, or KV usage >= KV_USAGE_HIGH with
    >= DECODE_WAITING_MIN requests waiting per instance."""
    cid = "decode_kv_short"
    pools = [p for p in ("decode", "pd") if w.has_pool(p)]
    if not pools:
        return [Check(cid, "not_applicable", detail="no decode or pd pool")]
    out = []
    for pool in pools:
        short, why, detail, ev = _decode_kv_evidence(w, pool)
        out.append(Check(cid, "not_evaluated", pool, why, ev) if why else
                   Check(cid, "symptom" if short else "ok", pool, detail, ev))
    return out


def check_goodput(w: Window, s: Settings) -> list[Check]:
    """API: the share of requests that can have met both SLOs is at most min(TTFT attainment,
    TPOT attainment) (and at least their sum - 1); below GOODPUT_MIN_FRACTION: far below."""
    cid = "goodput_low"
    ttft, tpot, e2e = w.histogram(TTFT, "api"), w.histogram(TPOT, "api"), w.histogram(E2E, "api")
    why = _too_few(TTFT, ttft, MIN_REQUESTS, "api") or _too_few(TPOT, tpot, MIN_REQUESTS, "api")
    if why:
        return [Check(cid, "not_evaluated", "api", why)]
    a, b = ttft.fraction_le(s.ttft_slo_s), tpot.fraction_le(s.tpot_slo_s)
    upper, lower = min(a, b), max(0.0, a + b - 1.0)
    rate = (e2e.count if e2e is not None else ttft.count) / w.duration_s
    ev = {"ttft_slo_s": s.ttft_slo_s, "tpot_slo_s": s.tpot_slo_s, "ttft_attainment": a, "tpot_attainment": b,
          "goodput_fraction_max": upper, "goodput_fraction_min": lower, "throughput_per_s": rate,
          "goodput_per_s_max": upper * rate}
    detail = (f"{a:.0%} of requests meet TTFT <= {s.ttft_slo_s:g}s, {b:.0%} meet TPOT <= {s.tpot_slo_s:g}s: "
              f"goodput {lower * rate:.2f}..{upper * rate:.2f} of {rate:.2f} req/s")
    return [Check(cid, "symptom" if upper < GOODPUT_MIN_FRACTION else "ok", "api", detail, ev)]


def _policies(w: Window, pool: str) -> list[str]:
    """Routing policies the router used for ``pool`` in the window."""
    return sorted({lb.get("policy", "?") for lb, _ in w.end.series(ROUTED, pool=pool)
                   if delta(w.start, w.end, ROUTED, **lb) > 0})


def check_prefix_cache(w: Window, s: Settings) -> list[Check]:
    """Prefill and pd pools: prefix-cache hit rate < PREFIX_HIT_RATE_MIN over at least
    PREFIX_MIN_QUERY_TOKENS looked-up prompt tokens."""
    cid = "prefix_cache_miss"
    pools = [p for p in ("prefill", "pd") if w.has_pool(p)]
    if not pools:
        return [Check(cid, "not_applicable", detail="no prefill or pd pool")]
    out = []
    for pool in pools:
        queries, hits = w.counter(PREFIX_QUERIES, pool=pool), w.counter(PREFIX_HITS, pool=pool)
        if queries < PREFIX_MIN_QUERY_TOKENS:
            out.append(Check(cid, "not_evaluated", pool, f"{queries:.0f} prompt tokens looked up in the prefix "
                             f"cache in the window, need {PREFIX_MIN_QUERY_TOKENS} (0 also when the engine runs "
                             "without prefix caching)"))
            continue
        rate, policies, n = hits / queries, _policies(w, pool), w.instances(pool)
        ev = {"hit_rate": rate, "query_tokens": queries, "hit_tokens": hits, "instances": n,
              "routing": ",".join(policies)}
        detail = f"{rate:.1%} of {queries:.0f} prompt tokens hit the cache ({n} instance(s), routing {ev['routing']})"
        if n > 1 and policies and "kv" not in policies:
            detail += "; this routing ignores the cache"
        disk_hits = w.counter(PREFIX_HITS, pool=pool, tier="disk")
        host_hits = w.counter(PREFIX_HITS, pool=pool, tier="host") + disk_hits  # (through the host tier)
        dropped = w.counter(KV_HOST_EVICTED, pool=pool)
        if host_hits or dropped:  # the host tier (--kv-host-cache-gb) says whether evicted blocks were hit later
            ev.update(host_hit_tokens=host_hits, host_evicted_blocks=dropped)
            detail += f"; {host_hits:.0f} of the hit tokens came back from the host tier"
            stored = w.counter(KV_DISK_STORED, pool=pool)
            if disk_hits or stored:  # a disk tier under it keeps what the host tier evicts: it drops only its own
                dropped = w.counter(KV_DISK_EVICTED, pool=pool)
                ev.update(disk_hit_tokens=disk_hits, disk_evicted_blocks=dropped)
                detail += f" ({disk_hits:.0f} read back from its disk tier)"
            if dropped:
                detail += (f", which dropped {dropped:.0f} blocks for lack of room: capacity limits the hit rate "
                           "(raise --kv-disk-cache-gb, --kv-host-cache-gb or --kv-cache-memory-gb)")
        out.append(Check(cid, "symptom" if rate < PREFIX_HIT_RATE_MIN else "ok", pool, detail, ev))
    return out


def check_pool_ratio(w: Window, s: Settings) -> list[Check]:
    """Prefill + decode pools: one pool overloaded (prefill: the queue test of
    ``prefill_queue_dominates_ttft`` without the TTFT share, and not under-used as in
    ``prefill_budget_small``; decode: the KV-shortage test or TPOT p95 above its SLO) while the
    other is busy at most POOL_IDLE_MAX of the window (prefill: execution seconds, decode: step
    seconds, per instance). The suggested pools split the instances as the work seconds split."""
    cid = "pool_ratio_mismatch"
    if not (w.has_pool("prefill") and w.has_pool("decode")):
        return [Check(cid, "not_applicable", detail="needs a prefill and a decode pool")]
    q, x = w.histogram(PREFILL_QUEUE, "prefill"), w.histogram(PREFILL, "prefill")
    step = w.histogram(DECODE_STEP, "decode")
    why = (_too_few(PREFILL_QUEUE, q, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
           or _too_few(DECODE_STEP, step, MIN_STEPS, "decode"))
    if why:
        return [Check(cid, "not_evaluated", detail=why)]
    n_p, n_d = max(1, w.instances("prefill")), max(1, w.instances("decode"))
    concurrency = x.sum / (w.duration_s * n_p)  # requests in prefill at once (batched prompts overlap)
    util_p, util_d = min(1.0, concurrency), min(1.0, step.sum / (w.duration_s * n_d))
    queueing = q.mean >= PREFILL_QUEUE_MIN_S and q.mean >= QUEUE_DOMINANCE_RATIO * x.mean
    prefill_over = queueing and concurrency >= PREFILL_CONCURRENCY_MIN  # else: prefill_budget_small's
    tpot = w.histogram(TPOT, "api")
    decode_over = _decode_kv_evidence(w, "decode")[0] or (
        tpot is not None and tpot.count >= MIN_REQUESTS and tpot.quantile(0.95) > s.tpot_slo_s)
    prompt_tok = w.counter(PREFIX_QUERIES, pool="prefill")
    itl, ttft = w.histogram(ITL, "api"), w.histogram(TTFT, "api")
    out_tok = (itl.count if itl else 0.0) + (ttft.count if ttft else 0.0)
    ev: dict[str, float | str] = {"prefill_busy": util_p, "decode_busy": util_d, "pools": f"p:{n_p},d:{n_d}",
                                  "prompt_tokens_per_s": prompt_tok / w.duration_s,
                                  "output_tokens_per_s": out_tok / w.duration_s}
    if out_tok:
        ev["input_output_ratio"] = prompt_tok / out_tok
    total = n_p + n_d
    need_p = x.sum / (x.sum + step.sum) if x.sum + step.sum > 0 else 0.5
    fired = (prefill_over and util_d <= POOL_IDLE_MAX) or (decode_over and util_p <= POOL_IDLE_MAX)
    detail = (f"p:{n_p},d:{n_d}: prefill busy {util_p:.0%} per instance{' and queueing' if queueing else ''}"
              f"{' (one prompt at a time: see prefill_budget_small)' if queueing and not prefill_over else ''}, "
              f"decode busy {util_d:.0%}{' and short of KV or over the TPOT SLO' if decode_over else ''}")
    if fired:  # keep the total and move instances toward the work split, else add one
        if prefill_over and util_d <= POOL_IDLE_MAX:
            p = min(total - 1, max(n_p + 1, round(total * need_p))) if n_d > 1 else n_p + 1
            d = total - p if n_d > 1 else n_d
        else:
            d = min(total - 1, max(n_d + 1, round(total * (1 - need_p)))) if n_p > 1 else n_d + 1
            p = total - d if n_p > 1 else n_p
        ev["suggested_pools"] = f"p:{p},d:{d}"
        detail += f"; try --pools p:{p},d:{d}"
    return [Check(cid, "symptom" if fired else "ok", None, detail, ev)]


def check_cancel_leak(w: Window, s: Settings) -> list[Check]:
    """Requests were cancelled in the window and, at its end, nothing is in flight (no open
    router request, nothing running or waiting on any engine instance) yet some engine
    instance still holds KV blocks (usage > 0; cached prefix blocks count as free)."""
    cid = "cancel_leak"
    cancelled = w.counter(CANCELLED)
    if not cancelled:
        return [Check(cid, "not_evaluated", detail=f"no request was cancelled in the window ({CANCELLED})")]
    engines = [p for p in ENGINE_POOLS if w.end.series(KV_USAGE, pool=p)]
    if not engines:
        return [Check(cid, "not_evaluated", detail=f"no engine pool exports {KV_USAGE}")]
    open_requests = w.end.total(ROUTER_REQUESTS)
    busy = sum(w.end.total(name, pool=p) for p in engines for name in (RUNNING, QUEUE_DEPTH))
    ev: dict[str, float | str] = {"cancelled": cancelled, "open_requests": open_requests}
    if open_requests or busy:
        return [Check(cid, "not_evaluated", detail=f"requests still in flight at the end of the window "
                      f"({open_requests:.0f} open in the router, {busy:.0f} running or waiting on workers): "
                      "judged only on an idle server", evidence=ev)]
    held = {lb.get("instance", "?"): v for p in engines for lb, v in w.end.series(KV_USAGE, pool=p) if v > 0}
    ev.update({f"kv_usage[{k}]": v for k, v in held.items()})
    if held:
        detail = (f"{cancelled:.0f} requests cancelled; idle now, yet KV usage is "
                  + ", ".join(f"{k} {v:.1%}" for k, v in sorted(held.items())))
        return [Check(cid, "symptom", None, detail, ev)]
    return [Check(cid, "ok", None, f"{cancelled:.0f} requests cancelled; idle now with every KV block free", ev)]


#: every check, in report order
CHECKS = (check_prefill_steals_decode, check_prefill_queue, check_decode_tpot_jitter, check_kv_transfer,
          check_decode_kv_short, check_goodput, check_prefix_cache, check_pool_ratio, check_cancel_leak)


def evaluate(w: Window, settings: Settings | None = None) -> list[Check]:
    """Run every check of :data:`CHECKS` on ``w``."""
    settings = settings or Settings()
    return [c for check in CHECKS for c in check(w, settings)]

