"""``epd plan correct``: fit the profile to a live server's traffic (:func:`fit_corrections`), after
Dynamo's planner's correction factors (``actual / expected`` TTFT and ITL of its last interval).

It reads ``/metrics`` twice, a window apart, takes the window's request rate, mean ISL and
OSL, pools, and the API's mean TTFT and ITL (:class:`Observation`), and solves for the two
factors on the profile's prefill seconds and decode step seconds with which the simulation of
that load (``--trace``: the lengths of the trace the traffic follows, at the observed rate;
else constant lengths at the observed means) gives the same means. They are written into the
profile, and ``recommend`` simulates with them. A profile is taken one request or one batch at
a time; under real traffic the workers also share what the profile cannot see (on one host:
the API's per-token work, the clients, other requests' KV transfers), which the factors absorb.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from epd.metrics import ITL, PREFILL, PROMPT_TOKENS, TTFT
from epd.ops.plan.errors import PlanError
from epd.ops.plan.fit import CORRECTION_RANGE, Profile
from epd.ops.plan.profile import model_info
from epd.ops.plan.simulate import simulate
from epd.ops.plan.workload import Workload, synthetic_workload
from epd.ops.scrape import MetricsError, Window, metrics_url, scrape
from epd.roles import Role

__all__ = ["MIN_OBSERVED_REQUESTS", "Observation", "corrected", "fit_corrections", "observe_server"]

#: requests a window must hold for ``epd plan correct`` to fit factors to it
MIN_OBSERVED_REQUESTS = 10


@dataclass(frozen=True, slots=True)
class Observation:
    """A live server's traffic over a window of its ``/metrics``: ``requests`` whose first
    token came out in it, ``rate`` (req/s), ``isl_mean`` (prompt tokens per prefill: the
    prefill pool's ``epd_prompt_tokens_total`` over its prefills, both counted as each ends),
    ``osl_mean`` (output chunks per request: the API's inter-token gaps per request + 1), the
    API's mean ``ttft_s`` and ``itl_s``, and the live ``prefill`` and ``decode`` instances;
    ``window_s``: seconds."""

    requests: int
    rate: float
    isl_mean: float
    osl_mean: float
    ttft_s: float
    itl_s: float
    prefill: int
    decode: int
    window_s: float

    @classmethod
    def from_window(cls, w: Window) -> Observation:
        """Raises PlanError when the window has no prefill and decode pool or too few requests."""
        if not (w.has_pool(Role.PREFILL) and w.has_pool(Role.DECODE)):
            raise PlanError(f"the server has no prefill and decode pools to correct (pools: {', '.join(w.pools())})")
        ttft, itl, pre = w.histogram(TTFT, "api"), w.histogram(ITL, "api"), w.histogram(PREFILL, Role.PREFILL)
        n = int(ttft.count) if ttft is not None else 0
        if n < MIN_OBSERVED_REQUESTS or pre is None or not pre.count or itl is None or not itl.count:
            raise PlanError(f"the window holds {n} requests with a first token (and "
                            f"{int(itl.count) if itl is not None else 0} later tokens); at least "
                            f"{MIN_OBSERVED_REQUESTS} streamed requests are needed: run the traffic during it, "
                            f"or widen --window")
        return cls(requests=n, rate=n / w.duration_s, isl_mean=w.counter(PROMPT_TOKENS, pool=Role.PREFILL) / pre.count,
                   osl_mean=itl.count / n + 1, ttft_s=ttft.mean, itl_s=itl.mean, prefill=w.instances(Role.PREFILL),
                   decode=w.instances(Role.DECODE), window_s=w.duration_s)


def observe_server(url: str, window_s: float, timeout_s: float = 30.0, model: str | None = None,
                   log=None) -> Observation:
    """Read ``url``'s ``/metrics`` twice, ``window_s`` seconds apart, while its traffic runs.
    ``model``: the profile's model, which the server must serve.

    Raises:
        PlanError: the server cannot be read, serves another model than ``model``, or the
            window is unusable (:meth:`Observation.from_window`).
    """
    import httpx

    try:
        with httpx.Client(timeout=timeout_s) as client:
            if model is not None:
                served, _ = model_info(client, metrics_url(url).removesuffix("/metrics"))
                if served != model:
                    raise PlanError(f"the profile is of {model!r} but {url} serves {served!r}: profile this server "
                                    f"first (`epd plan profile --url {url}`)")
            first = scrape(client, metrics_url(url))
            if log is not None:
                log(f"observing {url} for {window_s:g} s ...")
            time.sleep(window_s)
            return Observation.from_window(Window(first, scrape(client, metrics_url(url))))
    except MetricsError as e:
        raise PlanError(str(e)) from None
    except httpx.HTTPError as e:
        raise PlanError(f"cannot read {url}: {type(e).__name__}: {e}") from None


def _solve_factor(f, target: float, iters: int = 12) -> float:
    """The ``c`` in :data:`CORRECTION_RANGE` with ``f(c) = target`` for a nondecreasing ``f``
    (bisection on log c), clamped to the range's ends."""
    lo, hi = math.log(CORRECTION_RANGE[0]), math.log(CORRECTION_RANGE[1])
    if f(math.exp(lo)) >= target:
        return math.exp(lo)
    if f(math.exp(hi)) <= target:
        return math.exp(hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(math.exp(mid)) < target else (lo, mid)
    return math.exp((lo + hi) / 2)


def fit_corrections(profile: Profile, obs: Observation, workload: Workload | None = None, num_requests: int = 300,
                    rounds: int = 2) -> tuple[float, float]:
    """``(prefill_correction, decode_correction)``: the factors on the profile's prefill
    seconds and decode step seconds with which :func:`simulate`, run on the observed load
    on the observed pools, gives the observed mean TTFT and mean ITL. The load: ``workload``
    (the lengths the traffic follows, e.g. the trace being replayed) with its times rescaled
    to the observed rate, else a Poisson workload of ``num_requests`` requests of the observed
    mean ISL and OSL (constant lengths queue less than a trace's long tail, so a factor fitted
    on them comes out larger).

    After Dynamo's planner, which scales its profile's predictions by ``actual / expected``
    TTFT and ITL of the last interval (``prefill_correction``, ``decode_correction``). Here
    each factor scales a service time inside the simulation instead, solved for (bisection),
    so that queueing grows with it as it does on the server: at low load it is that ratio.
    What it absorbs is whatever the profile did not measure (on shared cores: the API, the
    clients and the KV transfers taking compute from the workers; the prompts' real template
    and tokenizer). The two are solved in turn, ``rounds`` times (they interact through the
    interference tables)."""
    if workload is None:
        w = synthetic_workload(max(1, round(obs.isl_mean)), max(1, round(obs.osl_mean)), obs.rate, num_requests)
    else:
        from epd.bench.arrivals import rescale_to_rate

        n = min(len(workload.arrival_s), max(num_requests, obs.requests))  # the first n rows: as many as were seen
        if n < 2:
            raise PlanError(f"{workload.source}: at least 2 rows are needed to replay it at the observed rate")
        w = Workload(np.asarray(rescale_to_rate(workload.arrival_s[:n], obs.rate), dtype=np.float64),
                     workload.input_len[:n], workload.output_len[:n], workload.source)
    cp = cd = 1.0
    for _ in range(rounds):
        cp = _solve_factor(lambda c, cd=cd: float(np.mean(simulate(corrected(profile, c, cd), w, obs.prefill,
                                                                   obs.decode)[0])), obs.ttft_s)
        cd = _solve_factor(lambda c, cp=cp: float(np.mean(simulate(corrected(profile, cp, c), w, obs.prefill,
                                                                   obs.decode)[1])), obs.itl_s)
    return cp, cd


def corrected(profile: Profile, prefill: float, decode: float, observed: dict | None = None) -> Profile:
    """``profile`` with the correction factors ``prefill`` and ``decode`` (and ``observed``, the
    window they were fitted to; None: the profile's)."""
    return replace(profile, prefill_correction=prefill, decode_correction=decode,
                   correction_observed=profile.correction_observed if observed is None else observed)
