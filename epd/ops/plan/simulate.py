"""``epd plan``'s discrete-event simulation of a workload through ``M`` prefill and ``K`` decode
instances (:func:`simulate`), after DistServe's (OSDI'24) placement search.

- prefill: ``M`` instances, each a FIFO single server (a prompt's chunks occupy the
  instance's steps until it is done; batching several prompts in one step does not raise a
  compute-bound worker's token throughput), a request joining the instance that frees up
  first; ``TTFT = queue wait + prefill_s(n) * slowdown(s) + overhead(s)``, ``s`` the decode
  streams running (in the simulation) when its prefill starts; without an interference
  table, slowdown 1 and the alone overhead.
- decode: ``K`` instances, a request (arriving when its prefill ends) joining the one with
  the fewest running streams; each instance steps all its running streams at once, one
  token each, the step lasting ``itl_s(batch, mean context)`` of the profile (continuous
  batching); every token's gap is one ITL sample. With a decode-under-prefill table, a
  step is slowed by ``slowdown(u)``, ``u`` the fraction of the ``M`` simulated prefill
  instances computing a prompt when the step starts (the prefill pool's utilization, 0..1,
  as the profile measured it on its pool; a larger pool is taken to bring its own cores or
  devices, so its interference scales with its utilization, not its size).

The two are coupled through ``s`` and ``u``: :func:`simulate` iterates prefill under the
previous round's decode streams and decode under the new prefills (their first tokens and
their busy intervals) to a fixed point. Times are seconds.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from epd.ops.plan.fit import DecodeFit, DecodeInterference, Interference, PrefillFit, Profile
from epd.ops.plan.workload import Workload

__all__ = ["SIM_ROUNDS", "SIM_TOL_S", "decode_run", "decode_slowdown_at", "prefill_busy_over_time", "prefill_run",
           "simulate", "simulate_decode", "simulate_prefill", "streams_over_time"]


def simulate_prefill(w: Workload, fit: PrefillFit, instances: int, interference: Interference | None = None,
                     streams_at=None, correction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """FIFO through ``instances`` single-server prefill instances. A request's service time
    is ``fit.seconds(input_len)`` times ``correction`` (the profile's ``prefill_correction``)
    times the interference slowdown at ``streams_at(start)``
    decode streams (a function of the time, s, the prefill starts; None: no streams), and
    ``TTFT = done - arrival + overhead`` (the interference's overhead at the same streams).
    Returns (TTFT s, time the request's first token is out, s) per request."""
    return prefill_run(w, fit, instances, interference, streams_at, correction)[:2]


def prefill_run(w: Workload, fit: PrefillFit, instances: int, interference: Interference | None = None,
                streams_at=None, correction: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`simulate_prefill`'s TTFT and first-token times and, per request, when its
    prefill compute starts and ends on its instance (s): the prefill pool's busy intervals."""
    interference = interference or Interference([], fit.overhead_s)
    free = [0.0] * instances
    heapq.heapify(free)
    base = fit.seconds(w.input_len.astype(np.float64)) * correction
    done = np.empty(len(w.arrival_s))
    begin = np.empty(len(w.arrival_s))
    overhead = np.empty(len(w.arrival_s))
    for i, (t, s) in enumerate(zip(w.arrival_s, base)):
        begin[i] = start = max(t, heapq.heappop(free))
        slow, overhead[i] = interference.at(streams_at(start) if streams_at is not None else 0.0)
        done[i] = start + s * float(slow)
        heapq.heappush(free, done[i])
    ttft = done - w.arrival_s + overhead
    return ttft, w.arrival_s + ttft, begin, done


def prefill_busy_over_time(start_s: np.ndarray, done_s: np.ndarray, per: float = 1.0):
    """A function of time t (s) -> prefill instances computing a prompt at t (``start <= t <
    done``, intervals of :func:`prefill_run`), over ``per``: with ``per`` the simulated
    pool's instances, the utilization (0..1) :class:`DecodeInterference` is read at."""
    starts, ends = sorted(map(float, start_s)), sorted(map(float, done_s))
    per = float(per) or 1.0

    def at(t: float) -> float:
        return (bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)) / per

    return at


def decode_run(w: Workload, fit: DecodeFit, instances: int, first_token_s: np.ndarray, slowdown_at=None,
               correction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """:func:`simulate_decode`'s gaps (s) and, per request, the time (s) of its last token
    (its first token's time when it has no later one)."""
    order = np.argsort(first_token_s, kind="stable")
    arrivals = [(float(first_token_s[i]), int(w.input_len[i]), int(w.output_len[i]) - 1, int(i)) for i in order
                if w.output_len[i] > 1]
    end = np.asarray(first_token_s, dtype=np.float64).copy()
    # per instance: running [context, tokens left, time of last token, request index]
    running: list[list[list[float]]] = [[] for _ in range(instances)]
    clock = [0.0] * instances
    gaps: list[float] = []
    nxt = 0
    while nxt < len(arrivals) or any(running):
        # the instance whose next step starts first; a new arrival joins before it if it is earlier
        busy = [k for k in range(instances) if running[k]]
        k = min(busy, key=lambda j: clock[j]) if busy else None
        if nxt < len(arrivals) and (k is None or arrivals[nxt][0] <= clock[k]):
            t, ctx, left, i = arrivals[nxt]
            nxt += 1
            j = min(range(instances), key=lambda j: len(running[j]))
            if not running[j]:
                clock[j] = max(clock[j], t)
            running[j].append([float(ctx), float(left), t, i])
            continue
        batch = running[k]
        step = fit.seconds(len(batch), sum(s[0] for s in batch) / len(batch)) * correction
        if slowdown_at is not None:  # decode under prefill: the factor when the step starts
            step *= slowdown_at(clock[k])
        clock[k] += step
        for s in batch:
            gaps.append(clock[k] - s[2])
            s[0] += 1
            s[1] -= 1
            s[2] = clock[k]
            if s[1] <= 0:
                end[int(s[3])] = clock[k]
        running[k] = [s for s in batch if s[1] > 0]
    return np.asarray(gaps), end


def simulate_decode(w: Workload, fit: DecodeFit, instances: int, first_token_s: np.ndarray,
                    slowdown_at=None, correction: float = 1.0) -> np.ndarray:
    """Continuous batching on ``instances`` decode instances (least running streams first);
    returns every inter-token gap (s) of every request's ``output_len - 1`` later tokens.
    ``slowdown_at``: a function of a step's start time (s) -> the factor its
    :class:`DecodeFit` seconds are multiplied by (None: 1; :func:`simulate` passes the
    decode-under-prefill slowdown at the prefill pool's simulated busy state); ``correction``:
    the profile's ``decode_correction``, multiplying every step."""
    return decode_run(w, fit, instances, first_token_s, slowdown_at, correction)[0]


def streams_over_time(first_token_s: np.ndarray, end_s: np.ndarray):
    """A function of time t (s) -> decode streams running at t (requests whose first token
    is out by t and whose last is not), over every decode instance."""
    starts, ends = np.sort(first_token_s), np.sort(end_s)

    def at(t: float) -> int:
        return int(np.searchsorted(starts, t, "right") - np.searchsorted(ends, t, "right"))

    return at


#: fixed-point rounds of :func:`simulate` and the TTFT change (s) that ends them early
SIM_ROUNDS = 12
SIM_TOL_S = 1e-4


def decode_slowdown_at(profile: Profile, start_s: np.ndarray, done_s: np.ndarray, prefill_instances: int):
    """A function of time t (s) -> the decode-under-prefill slowdown at the prefill pool's
    utilization at t (the prefill intervals ``start_s``..``done_s`` of a simulation of
    ``prefill_instances``), or None when the profile has no table (decode not slowed)."""
    table = DecodeInterference(profile.decode_interference)
    if not table:
        return None
    busy = prefill_busy_over_time(start_s, done_s, prefill_instances)
    return lambda t: table.at(busy(t))


def simulate(profile: Profile, w: Workload, prefill_instances: int, decode_instances: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Prefill and decode together: (TTFT s per request, every ITL gap s). Without an
    interference table, one pass of :func:`simulate_prefill` then :func:`simulate_decode`,
    each decode step slowed by the decode-under-prefill factor at the prefill pool's busy
    state when it starts (:func:`decode_slowdown_at`; 1 without that table). With a
    prefill-under-decode table, a fixed point: prefill is simulated under the decode
    streams of the previous round's decode simulation (none in the first), decode from that
    round's first tokens and under its prefills, until no TTFT moves by more than
    :data:`SIM_TOL_S` (at most :data:`SIM_ROUNDS` rounds; decode is a function of the
    prefill round, so a round whose TTFTs did not move leaves decode where it was)."""
    inter = Interference(profile.interference, profile.prefill.overhead_s)
    cp, cd = profile.prefill_correction, profile.decode_correction
    ttft, first, start, done = prefill_run(w, profile.prefill, prefill_instances, inter, correction=cp)
    gaps, end = decode_run(w, profile.decode, decode_instances, first,
                           decode_slowdown_at(profile, start, done, prefill_instances), cd)
    if not inter:
        return ttft, gaps
    for _ in range(SIM_ROUNDS):
        prev = ttft
        ttft, first, start, done = prefill_run(w, profile.prefill, prefill_instances, inter,
                                               streams_over_time(first, end), cp)
        gaps, end = decode_run(w, profile.decode, decode_instances, first,
                               decode_slowdown_at(profile, start, done, prefill_instances), cd)
        if np.max(np.abs(ttft - prev), initial=0.0) < SIM_TOL_S:
            break
    return ttft, gaps
