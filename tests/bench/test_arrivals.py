"""Arrival-process statistics on many seeded samples (no timing involved)."""

import math

import numpy as np
import pytest

from epd.bench.arrivals import arrival_times, rescale_to_rate


@pytest.mark.parametrize("rate,cv", [(2.0, 1.0), (0.5, 0.5), (10.0, 2.0), (3.0, 0.25)])
def test_mean_rate_and_cv(rate, cv):
    t = arrival_times(20_000, rate, cv, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert (len(t) - 1) / t[-1] == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_poisson_gaps_are_exponential():
    gaps = np.diff(arrival_times(20_000, 4.0, 1.0, seed=3))
    # exponential: P(gap > mean) = e^-1
    assert np.mean(gaps > 0.25) == pytest.approx(math.exp(-1), abs=0.02)


def test_seeded_and_edge_cases():
    assert np.array_equal(arrival_times(100, 1.0, 1.0, seed=7), arrival_times(100, 1.0, 1.0, seed=7))
    assert not np.array_equal(arrival_times(100, 1.0, 1.0, seed=7), arrival_times(100, 1.0, 1.0, seed=8))
    assert np.allclose(arrival_times(5, 2.0, 0.0), [0.0, 0.5, 1.0, 1.5, 2.0])  # cv 0: fixed interval
    assert np.array_equal(arrival_times(4, math.inf), np.zeros(4))  # all at once
    assert arrival_times(0, 1.0).size == 0 and arrival_times(1, 1.0).tolist() == [0.0]
    for bad in ((-1, 1.0, 1.0), (3, 0.0, 1.0), (3, -2.0, 1.0), (3, 1.0, -0.5), (3, 1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_times(*bad)


def test_rescale_trace_times_keeps_shape():
    t = np.array([10.0, 10.5, 12.0, 16.0, 20.0])
    r = rescale_to_rate(t, 2.0)
    assert r[0] == 0.0 and (len(r) - 1) / r[-1] == pytest.approx(2.0)
    assert np.allclose(np.diff(r) / np.diff(r).sum(), np.diff(t) / np.diff(t).sum())
    with pytest.raises(ValueError):
        rescale_to_rate(np.array([1.0, 1.0]), 1.0)
    with pytest.raises(ValueError):
        rescale_to_rate(t, 0.0)
