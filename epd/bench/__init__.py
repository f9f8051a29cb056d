"""``epd bench``: serving benchmark for any OpenAI-compatible server.

Load generator (gamma / Poisson arrivals, rate sweeps, trace replay), per-request TTFT,
TPOT, ITL and e2e, percentiles, SLO attainment and DistServe goodput, JSON + PNG output.
Importable from scripts (``benchmarks/disagg_vs_agg.py``)::

    from epd.bench import BenchConfig, run_bench
    result = asyncio.run(run_bench(BenchConfig("http://127.0.0.1:8000", workload="long-mix", rates=[0.5, 1])))
"""

from epd.bench.arrivals import arrival_times
from epd.bench.metrics import Goodput, RequestRecord, goodput, percentiles, slo_attainment, summarize, tpot
from epd.bench.runner import BenchConfig, format_table, run_bench
from epd.bench.workloads import RequestSpec, WorkloadOptions, build_requests

__all__ = ["BenchConfig", "Goodput", "RequestRecord", "RequestSpec", "WorkloadOptions", "arrival_times",
           "build_requests", "format_table", "goodput", "percentiles", "run_bench", "slo_attainment", "summarize",
           "tpot"]
