"""Request arrival processes: Poisson and, more generally, gamma-distributed gaps.

Gaps between arrivals are Gamma(shape k = 1/CV^2, scale = CV^2/rate): mean 1/rate and
coefficient of variation CV. CV = 1 is a Poisson process; CV < 1 is smoother, CV > 1
burstier; CV = 0 is a fixed interval. The same family vLLM's benchmark_serving uses
(``--burstiness`` = 1/CV^2).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, cv: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (s from the start, float64 ``[n]``, non-decreasing, first one 0) of ``n``
    requests at mean ``rate`` requests/s with gap coefficient of variation ``cv``.

    ``rate = inf`` sends everything at t = 0. Raises ValueError for ``n < 0``,
    ``rate <= 0`` or ``cv < 0``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not cv >= 0 or math.isinf(cv):
        raise ValueError(f"cv must be finite and >= 0, got {cv}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if cv == 0:
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        shape = 1.0 / cv**2
        gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def rescale_to_rate(times_s: np.ndarray, rate: float) -> np.ndarray:
    """Stretch or compress recorded arrival times (e.g. a trace) so the mean rate over
    them is ``rate`` requests/s, keeping their burstiness; shifted to start at 0.
    Raises ValueError for fewer than 2 distinct times or ``rate <= 0``."""
    t = np.asarray(times_s, dtype=np.float64)
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be finite and > 0, got {rate}")
    t = t - t.min() if t.size else t
    span = float(t.max()) if t.size else 0.0
    if t.size < 2 or span <= 0:
        raise ValueError(f"need at least two distinct arrival times to rescale to a rate: the {t.size} "
                         f"request(s) replayed all arrive at once; replay more rows, or leave out the rate to "
                         f"send them as recorded")
    return t * ((t.size - 1) / rate) / span
