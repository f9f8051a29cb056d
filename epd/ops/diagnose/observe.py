"""``epd diagnose``'s reading of a server: :func:`diagnose` scrapes its ``/metrics`` over a
window, runs the checks and returns the :class:`~epd.ops.diagnose.report.Report`."""

from __future__ import annotations

import time

from epd.ops.diagnose.checks import check_cancel_leak, evaluate
from epd.ops.diagnose.report import Report
from epd.ops.diagnose.summary import summarize
from epd.ops.diagnose.symptoms import Settings
from epd.ops.diagnose.thresholds import DEFAULT_INTERVAL_S, LEAK_CONFIRM_S
from epd.ops.scrape import Window, metrics_url, scrape

__all__ = ["diagnose"]


def diagnose(url: str, window_s: float = 60.0, *, interval_s: float = DEFAULT_INTERVAL_S,
             settings: Settings | None = None, ignore: tuple[str, ...] = (), timeout_s: float = 10.0,
             sleep=time.sleep) -> Report:
    """Scrape ``url``'s metrics over ``window_s`` seconds (gauges every ``interval_s``) and
    check every symptom. A suspected ``cancel_leak`` is read again after LEAK_CONFIRM_S.

    Raises:
        MetricsError: the server could not be read (at any of the scrapes).
    """
    import httpx

    target = metrics_url(url)
    with httpx.Client(timeout=timeout_s) as client:
        first = scrape(client, target)
        scrapes = [first]
        deadline = first.t + window_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sleep(min(interval_s, left))
            scrapes.append(scrape(client, target))
        window = Window(first, scrapes[-1], scrapes)
        settings = settings or Settings()
        checks = evaluate(window, settings)
        if any(c.id == "cancel_leak" and c.status == "symptom" for c in checks):
            sleep(LEAK_CONFIRM_S)
            scrapes.append(scrape(client, target))
            again = check_cancel_leak(Window(first, scrapes[-1], scrapes), settings)
            checks = [c for c in checks if c.id != "cancel_leak"] + again
    return Report(url, window.duration_s, len(scrapes), summarize(window), checks, tuple(ignore))
