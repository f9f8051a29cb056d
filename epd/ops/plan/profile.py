"""``epd plan profile``: measure a running server's real workers over HTTP (:func:`profile_server`).

- prefill: for each input length (default 64..2048 tokens, capped below the model's
  length), ``--repeats`` completions of fresh random token ids (no prefix-cache hit), one
  at a time, ``max_tokens=1``. Per request, the prefill workers' ``epd_prefill_seconds``
  (delta of the histogram over the request, read from ``/metrics`` with
  :mod:`epd.ops.scrape`) is the service time and the client's TTFT minus it is the fixed
  overhead (API, routing, KV transfer, first decode step); a window that also holds another
  request's prefill is measured again. The points timed alone give the
  :class:`~epd.ops.plan.fit.PrefillFit`.
- interference: ``--prefill-under-decode 0,4,16`` repeats the prefill pass under each
  number of long *streamed* decode requests (tokens read as server-sent events, as a
  streaming client does). Where prefill and decode workers share cores (a CPU box) or a
  device, the decode steps, and the API's per-token streaming, take compute from prefill,
  which a profile of prefill alone misses. Per stream count ``s``, the table keeps
  ``slowdown(s)`` and ``overhead(s)`` (:class:`~epd.ops.plan.fit.Interference`). On
  separate devices it measures a slowdown near 1.
- decode: for each context (prompt length, default 64 and 512) and batch size (default
  1, 2, 4, 8), that many concurrent requests of ``--decode-tokens`` tokens (``ignore_eos``).
  The decode workers' ``epd_decode_step_seconds`` over them gives the step time (a running
  stream's ITL) and, as decode tokens / steps, the mean running batch (the requests' prefills
  are staggered, so fewer than ``batch`` may run at once): the
  :class:`~epd.ops.plan.fit.DecodeFit`'s points.
- decode under prefill, the mirror of the interference above: ``--decode-under-prefill
  0,0.5,1`` times one decode point (the middle batch size, the shortest context, as the
  decode pass does it, at least 3 times per duty) while background requests of
  ``--prefill-load-tokens`` fresh input tokens (``max_tokens=1``) keep the prefill pool
  busy that fraction of the time (1: two clients back to back, so its queue never empties;
  below 1: one client idling ``(1 - duty) / duty`` of each request's time). Where the
  workers share cores or a device, prefill compute (and the KV transfer to the decode
  worker) slows the decode steps, which the decode profile above, taken with the prefill
  pool idle, misses. Per duty, the table keeps ``prefill_busy``, the fraction of a 1 s
  window of the background load alone that the prefill pool was busy as its workers
  measured it (``epd_prefill_seconds`` over the wall seconds and the pool's instances, at
  most 1; 0 for duty 0), and ``slowdown``, the median step time over the decode fit's at
  the measured mean batch and context, over the same median at duty 0 (the duties are
  timed interleaved, so a drift of the machine's load hits each; the requests' own
  staggered prefills are in every pass and in the decode fit, so they cancel).

Seconds throughout; the load is a fraction (0..1), the slowdown a ratio.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from epd.metrics import DECODE_STEP, PREFILL
from epd.ops.plan.errors import PlanError
from epd.ops.plan.fit import DecodeFit, Profile, fit_decode, fit_decode_interference, fit_interference, fit_prefill
from epd.ops.scrape import HistogramWindow, MetricsError, Window, metrics_url, scrape
from epd.roles import ROLE_NAMES, Role

__all__ = ["DEFAULT_BATCHES", "DEFAULT_CONTEXTS", "DEFAULT_PREFILL_LENGTHS", "model_info", "profile_server"]

DEFAULT_PREFILL_LENGTHS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (64, 512)
#: highest random token id of the profiling prompts: the tiny models' vocabularies are >= 400; real ones far larger
VOCAB_HI = 400


def _prefill_pool(w: Window) -> str:
    """The pool that prefills: ``prefill``, else ``pd``. Raises PlanError with neither."""
    pools = w.pools()
    for p in (Role.PREFILL, Role.PD):
        if p in pools:
            return p
    raise PlanError(f"no prefill or pd pool in the server's metrics (pools: {', '.join(pools) or 'none'})")


def model_info(client, base: str) -> tuple[str, int | None]:
    """(model id, its ``max_model_len`` or None) of the server at ``base`` (``GET /v1/models``).

    Raises:
        PlanError: a non-200 answer.
    """
    r = client.get(base + "/v1/models")
    if r.status_code != 200:
        raise PlanError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    m = r.json()["data"][0]
    return m["id"], m.get("max_model_len")


def _complete(client, base: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One non-streamed completion; returns its wall seconds."""
    t0 = time.perf_counter()
    r = client.post(base + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise PlanError(f"a profiling request failed: HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - t0


def _stream(client, base: str, model: str, prompt: list[int], max_tokens: int, done: threading.Event) -> None:
    """One streamed completion (server-sent events, one per token, as a streaming client
    reads them), read until its end or until ``done`` is set."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise PlanError(f"a background request failed: HTTP {r.status_code}")
        for line in r.iter_lines():
            if done.is_set() or line.strip() == "data: [DONE]":
                return
            if line.startswith("data: "):
                json.loads(line[6:])  # parsed, as a client does


class _Background:
    """``streams`` threads each running long-output streamed requests (64-token prompt, up
    to 1024 tokens, as many as the model's length allows) until :meth:`stop`: the decode
    load of ``streams`` running streams on the server, with the API's per-token streaming."""

    def __init__(self, client, base: str, model: str, streams: int, cap: int | None, rng: random.Random,
                 vocab_hi: int) -> None:
        self.done = threading.Event()
        tokens = max(2, min(1024, (cap or 2048) - 64))
        prompts = [[rng.randrange(10, vocab_hi) for _ in range(64)] for _ in range(streams)]

        def loop(prompt: list[int]) -> None:
            while not self.done.is_set():
                try:
                    _stream(client, base, model, prompt, tokens, self.done)
                except Exception:  # cancelled by stop(), or the server's own error
                    return

        self.threads = [threading.Thread(target=loop, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()
        if streams:
            time.sleep(1.0 + 0.1 * streams)  # their prefills are done: the measured windows see only decode steps

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join()


class _PrefillLoad:
    """Background prefills keeping ``url``'s prefill pool busy ``duty`` of the time until
    :meth:`stop`: completions of ``tokens`` fresh random input tokens, ``max_tokens=1``
    (prefill, its KV transfer, no decode step); ``duty >= 1``: two clients back to back, so
    the pool's queue never empties; below 1: one client that idles ``(1 - duty) / duty``
    of each request's wall seconds after it. The busy fraction reached is measured, not
    assumed (:func:`profile_server`)."""

    def __init__(self, client, base: str, model: str, duty: float, tokens: int, rng: random.Random,
                 vocab_hi: int) -> None:
        self.done = threading.Event()

        def loop(seed: int) -> None:
            r = random.Random(seed)
            while not self.done.is_set():
                try:
                    wall = _complete(client, base, model, [r.randrange(10, vocab_hi) for _ in range(tokens)], 1)
                except Exception:  # the server's own error; the measured busy fraction shows it
                    return
                if duty < 1:
                    self.done.wait(wall * (1 - duty) / duty)

        self.threads = [threading.Thread(target=loop, args=(rng.randrange(2**31),), daemon=True)
                        for _ in range(2 if duty >= 1 else 1)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # the first background prefills are running

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join()


def _prefill_busy(client, url: str, pool: str, instances: int, seconds: float = 1.0) -> float:
    """The ``pool`` prefill pool's busy fraction over the next ``seconds``: its
    ``epd_prefill_seconds`` over the window's wall seconds and ``instances``, at most 1
    (prompts batched into one step each count the step's seconds, so the sum can pass the
    wall time of a saturated pool)."""
    before = scrape(client, metrics_url(url))
    t0 = time.perf_counter()
    time.sleep(seconds)
    h = Window(before, scrape(client, metrics_url(url))).histogram(PREFILL, pool)
    wall = time.perf_counter() - t0
    return min(1.0, (h.sum if h is not None else 0.0) / (wall * instances))



@dataclass(slots=True)
class _Session:
    """One profiling run's server and its settings: ``client`` (an ``httpx.Client``), ``base``
    (the server URL without ``/v1`` or ``/metrics``), ``cap``: the longest prompt the model
    takes (``max_model_len - 2``; None: unknown)."""

    client: object
    url: str
    base: str
    model: str
    cap: int | None
    rng: random.Random
    log: object

    def prompt(self, n: int) -> list[int]:
        """``n`` fresh random token ids."""
        return [self.rng.randrange(10, VOCAB_HI) for _ in range(n)]

    def read(self):
        """A scrape of the server's ``/metrics``."""
        return scrape(self.client, metrics_url(self.url))

    def time_decode(self, pool: str, ctx: int, batch: int, decode_tokens: int) -> HistogramWindow:
        """``batch`` concurrent completions of ``ctx``-token prompts and ``decode_tokens`` tokens;
        the ``pool``'s decode steps over them. Raises PlanError when it observed none."""
        prompts = [self.prompt(ctx) for _ in range(batch)]
        before = self.read()
        with ThreadPoolExecutor(batch) as pool_:
            list(pool_.map(lambda pr: _complete(self.client, self.base, self.model, pr, decode_tokens), prompts))
        h = Window(before, self.read()).histogram(DECODE_STEP, pool)
        if h is None or not h.count:
            raise PlanError(f"the {pool} pool observed no {DECODE_STEP}")
        return h


def _check_fit_inputs(lens: list[int], lengths, batches, max_len: int | None, cap: int | None) -> None:
    """Raises PlanError unless ``fit_prefill`` and ``fit_decode`` can get 2 or more distinct
    lengths and batch sizes, checked before measuring."""
    few = []
    if len(lens) < 2:
        capped = f" (capped at the model's max_model_len {max_len} - 2)" if cap and max(lengths) > cap else ""
        few.append(f"--lengths {', '.join(map(str, lens))}{capped}")
    if len(set(batches)) < 2:
        few.append(f"--batches {', '.join(map(str, sorted(set(batches))))}")
    if few:
        raise PlanError(f"the fits need 2 or more distinct --lengths and --batches; got {' and '.join(few)}")


def _profile_prefill(s: _Session, pool: str, levels: list[int], lens: list[int], repeats: int) -> list[list[float]]:
    """``[input_tokens, prefill_s, ttft_s, decode_streams]`` points: ``repeats`` per length and
    stream count, each a request whose window held its prefill alone."""
    points = []
    for level in levels:
        background = _Background(s.client, s.base, s.model, level, s.cap, s.rng, VOCAB_HI)
        try:
            for n in lens:
                got = 0
                for _ in range(repeats * 6):  # a window that holds a background prefill is measured again
                    before = s.read()
                    ttft = _complete(s.client, s.base, s.model, s.prompt(n), 1)
                    h = Window(before, s.read()).histogram(PREFILL, pool)
                    if h is None or not h.count:
                        raise PlanError(f"the {pool} pool observed no {PREFILL} for a request")
                    if h.count == 1:
                        points.append([n, h.sum, ttft, level])
                        got += 1
                        if got == repeats:
                            break
                if got:
                    s.log(f"prefill {n:5d} tokens: {np.mean([p[1] for p in points[-got:]]) * 1e3:8.1f}"
                          f" ms" + (f" (under {level} decode streams)" if level else ""))
        finally:
            background.stop()
    return points


def _profile_decode(s: _Session, dpool: str, contexts, batches, decode_tokens: int) -> list[list[float]]:
    """``[mean batch, mean context, step_s]`` points, one per context and batch size.
    Raises PlanError when the requests never overlapped (one mean batch size)."""
    points = []
    for ctx in sorted({min(c, s.cap - decode_tokens) if s.cap else c for c in contexts}):
        for b in batches:
            h = s.time_decode(dpool, ctx, b, decode_tokens)
            # mean running batch: the decode tokens over the steps that made them
            batch = min(b, b * (decode_tokens - 1) / h.count)
            points.append([batch, ctx + decode_tokens / 2, h.mean])
            s.log(f"decode {b:3d} streams (mean batch {batch:4.1f}) context {ctx:5d}: step {h.mean * 1e3:7.2f} ms")
    if len({round(p[0], 6) for p in points}) < 2:
        raise PlanError(f"the decode requests of --batches {','.join(map(str, batches))} did not overlap (mean "
                        f"running batch {points[0][0]:.1f} each time), so the decode fit has one "
                        f"batch size: raise --decode-tokens (now {decode_tokens}) or the batch sizes")
    return points


def _profile_decode_under_prefill(s: _Session, pool: str, dpool: str, instances: int, duties: list[float],
                                  load_tokens: int, contexts, batches, decode_tokens: int, repeats: int,
                                  dfit: DecodeFit) -> list[list[float]]:
    """``[duty, prefill_busy, batch, context, step_s]`` points: the middle of ``batches`` at the
    shortest context, ``max(3, repeats)`` times per duty, the duties interleaved."""
    points: list[list[float]] = []
    b = sorted(batches)[len(batches) // 2]
    ctx = min(min(c, s.cap - decode_tokens) if s.cap else c for c in contexts)
    for _ in range(max(3, repeats)):  # the duties interleaved: a drift of the machine's load hits all
        for duty in duties:
            load = _PrefillLoad(s.client, s.base, s.model, duty, load_tokens, s.rng, VOCAB_HI) if duty > 0 else None
            try:
                busy = _prefill_busy(s.client, s.url, pool, instances) if load else 0.0
                h = s.time_decode(dpool, ctx, b, decode_tokens)
            finally:
                if load is not None:
                    load.stop()
            batch = min(b, b * (decode_tokens - 1) / h.count)
            context = ctx + decode_tokens / 2
            points.append([duty, busy, batch, context, h.mean])
            s.log(f"decode {b:3d} streams (mean batch {batch:4.1f}) context {ctx:5d} under prefill duty "
                  f"{duty:g} (busy {busy:.2f}): step {h.mean * 1e3:7.2f} ms, "
                  f"x{h.mean / max(dfit.seconds(batch, context), 1e-9):.2f} of the fit")
    return points


def profile_server(url: str, *, lengths=DEFAULT_PREFILL_LENGTHS, repeats: int = 3, batches=DEFAULT_BATCHES,
                   contexts=DEFAULT_CONTEXTS, decode_tokens: int = 64, prefill_background: int | tuple[int, ...] = 0,
                   decode_under_prefill: tuple[float, ...] = (), prefill_load_tokens: int = 512,
                   seed: int | None = None, timeout_s: float = 300.0, log=None) -> Profile:
    """Measure ``url``'s prefill and decode (the module docstring says how). Lengths and
    contexts are capped so prompt + output fits the model's ``max_model_len``.
    ``prefill_background``: the decode stream counts prefill is timed under, one pass each
    (0: prefill alone); two or more give the profile's interference table.
    ``seed``: of the random prompts (None: fresh ones on every call, so a second profile of
    the same server does not time prefix-cache hits of the first one's prompts).
    ``decode_under_prefill``: the prefill duty cycles (0..1) one decode point (the middle
    of ``batches``, the shortest context, ``max(3, repeats)`` times) is timed under, with
    background prefills of ``prefill_load_tokens`` input tokens; any duty above 0 gives the
    profile's decode-under-prefill table (none: decode timed with the prefill pool idle only).

    Raises:
        PlanError: the server cannot be read, has no prefill/pd pool, or a request fails.
    """
    import httpx

    log = log or (lambda msg: None)
    levels = sorted({int(prefill_background)} if isinstance(prefill_background, int) else set(prefill_background))
    base = metrics_url(url).removesuffix("/metrics")
    try:
        with httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max(levels) + 16)) as client:
            model, max_len = model_info(client, base)
            cap = (max_len - 2) if max_len else None
            s = _Session(client, url, base, model, cap, random.Random(seed), log)
            first = s.read()
            w0 = Window(first, first)
            pool = _prefill_pool(w0)
            pools = {p: w0.instances(p) for p in w0.pools() if p in ROLE_NAMES}
            lens = sorted({min(n, cap) if cap else n for n in lengths})
            _check_fit_inputs(lens, lengths, batches, max_len, cap)
            _complete(client, base, model, s.prompt(16), 1)  # warm-up
            prefill_points = _profile_prefill(s, pool, levels, lens, repeats)
            dpool = next((p for p in (Role.DECODE, Role.PD) if p in pools), None)
            if dpool is None:
                raise PlanError(f"no decode or pd pool in the server's metrics (pools: {', '.join(pools)})")
            decode_points = _profile_decode(s, dpool, contexts, batches, decode_tokens)
            dfit = fit_decode(decode_points)
            duties = sorted(set(decode_under_prefill)) if any(d > 0 for d in decode_under_prefill) else []
            load_tokens = min(prefill_load_tokens, cap) if cap else prefill_load_tokens
            dup_points = _profile_decode_under_prefill(s, pool, dpool, max(1, pools.get(pool, 1)), duties, load_tokens,
                                                       contexts, batches, decode_tokens, repeats, dfit)
    except httpx.HTTPError as e:
        raise PlanError(f"cannot profile {url}: {type(e).__name__}: {e}") from None
    except MetricsError as e:
        raise PlanError(str(e)) from None
    fit = fit_prefill(prefill_points)
    return Profile(model=model, pools=pools, prefill=fit, decode=dfit,
                   prefill_points=prefill_points, decode_points=decode_points, tp={p: 1 for p in pools}, url=url,
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   prefill_under_decode=max(levels), interference=fit_interference(prefill_points, fit),
                   decode_under_prefill=[float(d) for d in duties],
                   decode_under_prefill_tokens=load_tokens if duties else 0,
                   decode_under_prefill_points=dup_points,
                   decode_interference=fit_decode_interference(dup_points, dfit), max_model_len=int(max_len or 0))
