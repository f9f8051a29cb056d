"""``epd diagnose``: read a running server's ``/metrics`` over a window and name its bottleneck.

It reads ``URL/metrics`` at the start and at the end of ``--window`` seconds, and every
``--interval`` seconds in between for the gauges, and computes per pool, over the window
only (deltas of the counters and of the histogram buckets, :mod:`epd.ops.scrape`):

- rates: requests/s, prompt and output tokens/s, KV bytes/s, decode steps/s;
- count, mean and p50/p95/p99 of every stage histogram (seconds), from the bucket deltas
  (linear interpolation inside a bucket, as PromQL's ``histogram_quantile``: a quantile is
  only as fine as the buckets of epd/metrics.py);
- KV usage, queue depth and running batch (mean and max of the gauge samples),
  preemptions, prefix- and encoder-cache hit rates, cancellations, KV transfer failures.

Then it runs the checks of :data:`~epd.ops.diagnose.checks.CHECKS`, one or more per symptom of
:data:`~epd.ops.diagnose.symptoms.SYMPTOMS`. Each check ends ``symptom`` (with its evidence,
likely cause and the fix to try), ``ok``, ``not_applicable`` (the pool it is about is not
deployed) or ``not_evaluated`` (a metric it needs is missing or has fewer observations in the
window than the check's minimum, so an idle server has no symptom, yet is not called healthy:
see the verdicts below). The thresholds are the constants of :mod:`epd.ops.diagnose.thresholds`.

Where the numbers come from (epd/metrics.py): the request-level latencies (TTFT, TPOT,
ITL, e2e) and cancellations are observed by the API, ``pool="api"``; ``prefill_queue``,
``prefill`` and ``kv_transfer`` by prefill workers; ``decode_queue`` by decode workers;
``decode_step`` by decode and aggregated (``pd``) workers; gauges and the prefix-cache
and preemption counters by every engine worker; retries, migrations and routing
decisions by the router (labelled with the pool they concern).

Verdict and exit code (:attr:`~epd.ops.diagnose.report.Report.status`):

- ``symptoms``, exit 1: at least one symptom (whatever the traffic);
- ``healthy``, exit 0: no symptom, and at least one check was evaluated (judged ``ok``);
- ``no_traffic``, exit 3: no request in the window (no TTFT, e2e or routing decision), so
  nothing was judged: the server is idle, not found healthy;
- ``too_little_traffic``, exit 3: some requests, but no check had the observations it
  needs (every one ``not_evaluated`` or ``not_applicable``);
- exit 2: the server could not be read.

Units: ``prefix_*`` cache counts are prompt tokens (``epd_prefix_cache_*_tokens_total``);
``epd_kv_transfer_requests_total`` counts NIXL READ/WRITE operations, not client requests
(one per layer, and per TP rank with per-rank agents, for each P->D transfer), reported
here as ``kv_transfer_ops`` and ``nixl_ops_per_transfer``.

Modules: :mod:`~epd.ops.diagnose.thresholds`, :mod:`~epd.ops.diagnose.symptoms` (what can be
found), :mod:`~epd.ops.diagnose.checks`, :mod:`~epd.ops.diagnose.summary` (the per-pool
numbers), :mod:`~epd.ops.diagnose.report`, :mod:`~epd.ops.diagnose.observe` (reading a server
over a window) and :mod:`~epd.ops.diagnose.cli` (the subcommand). The package exports their
public names.
"""

from epd.ops.diagnose.checks import CHECKS, evaluate
from epd.ops.diagnose.observe import diagnose
from epd.ops.diagnose.report import Report
from epd.ops.diagnose.summary import STAGES, summarize
from epd.ops.diagnose.symptoms import STATUSES, SYMPTOMS, Check, Settings
from epd.ops.scrape import HistogramWindow, MetricsError, Scrape, Window, parse_metrics, scrape

__all__ = ["CHECKS", "STAGES", "STATUSES", "SYMPTOMS", "Check", "HistogramWindow", "MetricsError", "Report", "Scrape",
           "Settings", "Window", "diagnose", "evaluate", "parse_metrics", "scrape", "summarize"]
