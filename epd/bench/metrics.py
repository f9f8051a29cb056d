"""Per-request latency records and the arithmetic of serving benchmarks.

Definitions (DistServe, Zhong et al., OSDI'24; vLLM ``benchmarks/benchmark_serving.py``):

* TTFT: time from sending the request to the first streamed content chunk.
* ITL: every gap between two successive content chunks (a chunk that carries several
  tokens counts as one gap, as vLLM's and genai-perf's ITL do).
* TPOT = (t_last - t_first) / (n_out - 1): decode time per output token after the first.
  Undefined for n_out <= 1 (``None``); such a request meets any TPOT SLO.
* e2e: send to end of stream.
* SLO attainment: share of *issued* requests (failed ones count as misses) whose TTFT
  and TPOT are within the SLOs.
* goodput: the highest request rate at which at least ``target`` (90 %) of requests meet
  both SLOs, from a rate sweep with linear interpolation between the two sweep points
  around the crossing; divided by devices for goodput per device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request's measured life. Times in seconds; ``chunk_s`` are the arrival times of
    the content chunks relative to ``sent_s`` (the first one is the TTFT)."""

    index: int
    kind: str
    scheduled_s: float
    sent_s: float = 0.0
    max_tokens: int = 0
    prompt_tokens: int | None = None
    ok: bool = False
    error: str | None = None
    chunk_s: list[float] = field(default_factory=list)
    n_out: int = 0
    n_out_source: str = "chunks"
    cached_tokens: int | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.chunk_s[0], self.chunk_s[-1], self.n_out) if self.chunk_s else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, itls_s=self.itls_s)
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


def tpot(t_first_s: float, t_last_s: float, n_out: int) -> float | None:
    """Time per output token (s) after the first: (t_last - t_first) / (n_out - 1).

    ``None`` when ``n_out <= 1`` (no decode step to time). Raises ValueError when
    ``t_last_s < t_first_s`` or ``n_out < 0``."""
    if n_out < 0:
        raise ValueError(f"n_out must be >= 0, got {n_out}")
    if t_last_s < t_first_s:
        raise ValueError(f"t_last ({t_last_s}) is before t_first ({t_first_s})")
    if n_out <= 1:
        return None
    return (t_last_s - t_first_s) / (n_out - 1)


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", ...}`` of ``values`` (linear interpolation between closest
    ranks, numpy's default); every entry ``None`` when there are no values."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {"mean": None} | {f"p{p:g}": None for p in ps}
    return {"mean": float(arr.mean())} | {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}


def meets_slo(rec: RequestRecord, ttft_slo_s: float | None, tpot_slo_s: float | None) -> tuple[bool, bool]:
    """(TTFT met, TPOT met) for one request; a failed request or one without output meets
    neither; ``None`` SLOs are always met; TPOT is met when undefined (n_out <= 1)."""
    if not rec.ok or rec.ttft_s is None:
        return False, False
    ttft_ok = ttft_slo_s is None or rec.ttft_s <= ttft_slo_s
    t = rec.tpot_s
    tpot_ok = tpot_slo_s is None or t is None or t <= tpot_slo_s
    return ttft_ok, tpot_ok


def slo_attainment(records: Sequence[RequestRecord], ttft_slo_s: float | None,
                   tpot_slo_s: float | None) -> dict[str, float | None]:
    """Shares (0..1) of requests meeting the TTFT SLO, the TPOT SLO and both; ``None``
    for an empty list."""
    if not records:
        return {"ttft": None, "tpot": None, "both": None}
    met = [meets_slo(r, ttft_slo_s, tpot_slo_s) for r in records]
    n = len(records)
    return {"ttft": sum(a for a, _ in met) / n, "tpot": sum(b for _, b in met) / n,
            "both": sum(a and b for a, b in met) / n}


def summarize(records: Sequence[RequestRecord], duration_s: float, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None) -> dict:
    """Latency percentiles (seconds), throughput over ``duration_s`` (first send to last
    finish) and SLO attainment of one run."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.n_out for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_token_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "output_tokens": out_tokens,
        "ttft_s": percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": percentiles(r.tpot_s for r in ok if r.tpot_s is not None),
        "itl_s": percentiles(x for r in ok for x in r.itls_s),
        "e2e_s": percentiles(r.e2e_s for r in ok if r.e2e_s is not None),
        "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
        "attainment": slo_attainment(records, ttft_slo_s, tpot_slo_s),
    }


@dataclass(frozen=True, slots=True)
class Goodput:
    """``rate`` in requests/s. ``status``: "interpolated" (between two sweep points),
    "exact" (a sweep point sits on the target), "lower_bound" (every swept rate met the
    target: the true goodput is at least ``rate``), "never_met" (no swept rate met it:
    ``rate`` is 0, the true goodput is below the lowest swept rate)."""

    rate: float
    status: str
    target: float

    def per_device(self, num_devices: int) -> float:
        """Requests/s per device; raises ValueError for ``num_devices < 1``."""
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        return self.rate / num_devices


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> Goodput:
    """DistServe goodput from a rate sweep: the highest rate whose attainment (share of
    requests meeting both SLOs) is >= ``target``, linearly interpolated towards the next
    higher swept rate (whose attainment is below the target).

    ``rates`` (req/s, any order, distinct) and ``attainments`` (0..1) pair up. Raises
    ValueError on empty input, length mismatch, duplicate or non-finite rates."""
    if len(rates) != len(attainments) or not rates:
        raise ValueError("rates and attainments must be non-empty and of equal length")
    if len(set(rates)) != len(rates) or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"rates must be distinct, finite and > 0, got {list(rates)}")
    pts = sorted(zip(rates, attainments))
    meeting = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not meeting:
        return Goodput(0.0, "never_met", target)
    i = meeting[-1]
    r0, a0 = pts[i]
    if i == len(pts) - 1:
        return Goodput(r0, "lower_bound", target)
    if a0 == target:
        return Goodput(r0, "exact", target)
    r1, a1 = pts[i + 1]
    return Goodput(r0 + (a0 - target) * (r1 - r0) / (a0 - a1), "interpolated", target)
