"""``epd plan recommend``: the smallest pool set meeting the TTFT and ITL SLOs (:func:`recommend`),
after Dynamo's SLA planner (replica counts from a profile's predicted load) and DistServe's
placement search (simulate each candidate, keep the smallest that meets the SLOs).

The p90 over the simulated requests (TTFT) and tokens (ITL) are the predictions. Without
interference prefill only depends on ``M`` and decode on ``K`` (given the prefills: their
ends and, with a decode-under-prefill table, their busy intervals), so the search takes the
smallest ``M`` meeting the TTFT SLO, then the smallest ``K`` meeting the ITL SLO; with it,
the two searches alternate until neither moves, within ``--max-devices`` (``M*tp_p +
K*tp_d``; TP is the profile's ``tp`` per pool, which ``profile`` writes as 1: the TP of the
profiled workers is not read from the server, so a profile of TP workers needs its ``tp``
edited). ``e:N``: the traces hold no media, so the encode pool is 0 (the profile's encode
instances are not sized). Not modelled: KV capacity (preemption when a decode instance's
cache is full), ``max_num_seqs``, prefix-cache hits, chunked prefill sharing steps with
decodes (aggregated ``pd`` pools; their decode-under-prefill table measures the shared
steps, but at one batch size), and the interference between more instances than the
profiled server had (the tables are measured on its pools, e.g. ``p:1,d:1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epd.ops.plan.errors import PlanError
from epd.ops.plan.fit import Profile
from epd.ops.plan.simulate import decode_slowdown_at, prefill_run, simulate, simulate_decode
from epd.ops.plan.workload import Workload
from epd.roles import ROLE_SHORT, Role

__all__ = ["QUANTILE", "Prediction", "extrapolation_warnings", "pools_text", "recommend"]

#: the quantile the SLOs are judged at (Dynamo's planner and DistServe: p90)
QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class Prediction:
    """One pool set's predicted p90s (s); ``meets``: both within the SLOs."""

    encode: int
    prefill: int
    decode: int
    ttft_p90_s: float
    itl_p90_s: float
    meets: bool

    @property
    def pools(self) -> str:
        """The pool set in ``epd launch --pools`` syntax, e.g. ``e:0,p:2,d:1``."""
        return f"e:{self.encode},p:{self.prefill},d:{self.decode}"


def pools_text(pools: dict[str, int]) -> str:
    """``pools`` (pool name -> instances) in ``epd launch --pools`` syntax, e.g. ``p:1,d:1``;
    pools that are not sized (router, api) are left out."""
    return ",".join(f"{ROLE_SHORT[p]}:{pools[p]}" for p in Role if p in pools)


def _p90(x: np.ndarray) -> float:
    """The :data:`QUANTILE` of ``x`` (0 when empty)."""
    return float(np.quantile(x, QUANTILE)) if len(x) else 0.0


def recommend(profile: Profile, workload: Workload, ttft_slo_s: float, itl_slo_s: float,
              max_devices: int = 16) -> tuple[Prediction, list[Prediction]]:
    """The smallest pool set meeting both SLOs (the search of the module docstring) and the
    candidates tried. When none fits ``max_devices``, the returned prediction is the
    largest tried, ``meets=False``."""
    tp_p, tp_d = profile.tp.get(Role.PREFILL, 1), profile.tp.get(Role.DECODE, 1)
    if tp_p + tp_d > max_devices:
        raise PlanError(f"--max-devices {max_devices} cannot hold one prefill (tp {tp_p}) and one decode "
                        f"(tp {tp_d}) instance")
    tried: list[Prediction] = []
    seen: dict[tuple[int, int], Prediction] = {}
    kept = profile.pools.get(Role.ENCODE, 0)  # media is not modelled: the encode pool stays as profiled

    def predict(m: int, k: int) -> Prediction:
        if (m, k) not in seen:
            ttft, gaps = simulate(profile, workload, m, k)
            t, g = _p90(ttft), _p90(gaps)
            seen[m, k] = Prediction(kept, m, k, t, g, t <= ttft_slo_s and g <= itl_slo_s)
            tried.append(seen[m, k])
        return seen[m, k]

    if not profile.interference:  # prefill does not depend on the decode pool: size it first, alone
        runs = {}
        for m in range(1, (max_devices - tp_d) // tp_p + 1):
            runs[m] = prefill_run(workload, profile.prefill, m, correction=profile.prefill_correction)
            ttft_p90 = _p90(runs[m][0])
            tried.append(Prediction(kept, m, 0, ttft_p90, math.nan, False))
            if ttft_p90 <= ttft_slo_s:
                break
        else:  # none meets the TTFT SLO: the fewest instances as close to it as any
            closest = min(p.ttft_p90_s for p in tried)
            m = min(p.prefill for p in tried if p.ttft_p90_s <= closest * 1.02)
            ttft_p90 = _p90(runs[m][0])
        _, first, start, done = runs[m]
        slowdown_at = decode_slowdown_at(profile, start, done, m)  # decode under this M's prefills
        for k in range(1, (max_devices - m * tp_p) // tp_d + 1):
            itl_p90 = _p90(simulate_decode(workload, profile.decode, k, first, slowdown_at,
                                           profile.decode_correction))
            tried.append(Prediction(kept, m, k, ttft_p90, itl_p90, ttft_p90 <= ttft_slo_s and itl_p90 <= itl_slo_s))
            if itl_p90 <= itl_slo_s:
                break
        return _closest(tried, ttft_slo_s, itl_slo_s, tp_p, tp_d), tried
    # with interference, prefill slows with the decode streams, which the decode pool's speed sets:
    # the smallest M for the current K, then the smallest K for that M, until neither moves
    m = k = 1
    for _ in range(4):
        for m2 in range(1, (max_devices - k * tp_d) // tp_p + 1):
            if predict(m2, k).ttft_p90_s <= ttft_slo_s:
                break
        for k2 in range(1, (max_devices - m2 * tp_p) // tp_d + 1):
            if predict(m2, k2).itl_p90_s <= itl_slo_s:
                break
        if (m2, k2) == (m, k):
            break
        m, k = m2, k2
    best = seen[m2, k2]
    if not best.meets:  # the alternation can stop at a pair with a later, smaller one meeting both
        best = _closest(tried, ttft_slo_s, itl_slo_s, tp_p, tp_d)
    return best, tried


def _closest(tried: list[Prediction], ttft_slo_s: float, itl_slo_s: float, tp_p: int, tp_d: int) -> Prediction:
    """The smallest of the fully simulated candidates that meets both SLOs, else the smallest of
    those whose worse SLO ratio (p90 over SLO) is within 2 % of the best one's: more devices
    that do not bring the prediction closer are not recommended."""
    full = [p for p in tried if not math.isnan(p.itl_p90_s)]
    size = lambda p: (p.prefill * tp_p + p.decode * tp_d, p.prefill)  # noqa: E731
    if any(p.meets for p in full):
        return min((p for p in full if p.meets), key=size)
    ratio = {id(p): max(p.ttft_p90_s / ttft_slo_s, p.itl_p90_s / itl_slo_s) for p in full}
    best = min(ratio.values())
    return min((p for p in full if ratio[id(p)] <= best * 1.02), key=size)


def extrapolation_warnings(profile: Profile, workload: Workload) -> list[str]:
    """Where ``workload`` leaves what ``profile`` measured, in words: prompts longer than the
    longest profiled prefill (their prefill time comes from the fit's quadratic, outside the
    points it was fitted to). Empty for a profile without points (written by hand)."""
    if not profile.prefill_points or not len(workload.input_len):
        return []
    longest = int(max(p[0] for p in profile.prefill_points))
    over = int((workload.input_len > longest).sum())
    if not over:
        return []
    return [f"{over} of {len(workload.input_len)} prompts are longer than the longest profiled ({longest} "
            f"tokens; the longest is {int(workload.input_len.max())}): their prefill time is extrapolated from "
            f"the fit; profile with --lengths up to {int(workload.input_len.max())} to measure it"]
