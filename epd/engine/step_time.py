"""A step-time model fitted online, and the prefill share it allows under a target.

Stall-free batching (Sarathi-Serve, Agrawal et al., OSDI 2024) bounds the prompt tokens
a step carries while sequences decode, so the step, and with it every decoding stream's
inter-token latency, stays under a target time. Sarathi-Serve derives its token budget
from a profile taken before serving; here the engine fits the same kind of cost model
to its own recent steps, so the budget follows the hardware, the model, the dtype and,
on a shared CPU host, the cores the step actually got:

    step_ms ~ c0 + c1 * decodes + c2 * decode_context / 1e3
                 + c3 * prefill_tokens + c4 * sum(chunk_tokens * chunk_context) / 1e6

(the last term is a chunk's attention over its context), by ridge-regularized least
squares over the last ``window`` steps, refitted every ``refit_every`` steps (steps whose
residual is past 3x the median, e.g. ones the OS preempted, are dropped and the fit
repeated), with every coefficient clipped at zero. The prefill budget is then the largest chunk whose predicted
step time stays under the target (a binary search, the chunk's attention term included).
"""

from __future__ import annotations

import numpy as np

NUM_FEATURES = 5


def step_features(decodes: int, decode_context: int, chunks: list[tuple[int, int]]) -> np.ndarray:
    """Feature row [NUM_FEATURES] float64 of a step: ``decodes`` sequences decoding over
    ``decode_context`` context tokens in all; ``chunks``: (tokens, context after the
    chunk) of each prompt chunk."""
    prefill = sum(n for n, _ in chunks)
    attn = sum(n * ctx for n, ctx in chunks)
    return np.array([1.0, decodes, decode_context / 1e3, prefill, attn / 1e6])


class StepTimeModel:
    """Online linear model of a step's wall time in ms.

    Args:
        window: steps kept for the fit.
        refit_every: steps between fits.
        min_mixed_steps: steps that carried both decodes and prompt tokens needed before
            ``prefill_budget`` trusts the fit (until then it returns None).
    """

    def __init__(self, window: int = 256, refit_every: int = 8, min_mixed_steps: int = 4) -> None:
        self.window, self.refit_every, self.min_mixed_steps = window, refit_every, min_mixed_steps
        self._x = np.zeros((window, NUM_FEATURES))
        self._y = np.zeros(window)
        self._mixed = np.zeros(window, dtype=bool)
        self._n = 0  # steps observed
        self.coef: np.ndarray | None = None

    def observe(self, features: np.ndarray, step_ms: float) -> None:
        """Record one step: ``features`` from ``step_features``, its wall time in ms."""
        i = self._n % self.window
        self._x[i], self._y[i] = features, step_ms
        self._mixed[i] = features[1] > 0 and features[3] > 0
        self._n += 1
        if self._n % self.refit_every == 0:
            self._fit()

    def _fit(self) -> None:
        k = min(self._n, self.window)
        if self._mixed[:k].sum() < self.min_mixed_steps:
            self.coef = None
            return
        x, y = self._x[:k], self._y[:k]
        coef = _ridge(x, y)
        # A step the OS preempted (a shared host) is an outlier: drop those, fit again.
        resid = np.abs(x @ coef - y)
        keep = resid <= 3.0 * max(float(np.median(resid)), 0.05 * float(np.median(y)))
        if keep.sum() >= NUM_FEATURES and not keep.all():
            coef = _ridge(x[keep], y[keep])
        self.coef = np.maximum(coef, 0.0)

    def predict(self, features: np.ndarray) -> float | None:
        """Predicted step time in ms (None: not fitted yet)."""
        return None if self.coef is None else float(features @ self.coef)

    def prefill_budget(self, target_ms: float, decodes: int, decode_context: int, chunk_context: int,
                       lo: int, hi: int) -> int | None:
        """Most prompt tokens in ``[lo, hi]`` a step with ``decodes`` decodes over
        ``decode_context`` tokens may carry and stay under ``target_ms``, the chunk
        starting after ``chunk_context`` cached tokens; ``lo`` when even ``lo`` exceeds
        it (prompts always progress). None: the model is not fitted yet."""
        if self.coef is None:
            return None
        hi = max(lo, hi)

        def ms(n: int) -> float:
            return float(step_features(decodes, decode_context, [(n, chunk_context + n)]) @ self.coef)

        if ms(hi) <= target_ms:
            return hi
        a, b = lo, hi  # ms(a) <= target < ms(b), or a == lo
        while b - a > 1:
            m = (a + b) // 2
            if ms(m) <= target_ms:
                a = m
            else:
                b = m
        return a


def _ridge(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``y`` on ``x`` with a small ridge (columns scaled to unit range)."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-9)
    lam = 1e-6 * len(y)
    a = np.vstack([x / scale, np.sqrt(lam) * np.eye(x.shape[1])])
    b = np.concatenate([y, np.zeros(x.shape[1])])
    return np.linalg.lstsq(a, b, rcond=None)[0] / scale
