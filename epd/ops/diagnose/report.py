"""``epd diagnose``'s report (:class:`Report`): the verdict and exit code, the text report
(stage and pool tables, symptoms with their cause and fix) and the JSON one."""

from __future__ import annotations

from dataclasses import dataclass

from epd.ops.diagnose.format import json_safe, ms, percent, table
from epd.ops.diagnose.symptoms import SYMPTOMS, Check
from epd.ops.scrape import ENGINE_POOLS

__all__ = ["Report"]


@dataclass(slots=True)
class Report:
    """Everything ``epd diagnose`` found: ``window_s`` (seconds between the two scrapes),
    ``pools`` (:func:`summarize`), ``checks`` (:func:`evaluate`), ``ignored`` (ids)."""

    url: str
    window_s: float
    scrapes: int
    pools: dict[str, dict]
    checks: list[Check]
    ignored: tuple[str, ...] = ()

    @property
    def symptoms(self) -> list[Check]:
        return [c for c in self.checks if c.status == "symptom" and c.id not in self.ignored]

    @property
    def requests(self) -> float:
        """Requests seen in the window: the most of the API's TTFT and e2e observations and
        of any pool's routing decisions (0: no traffic)."""
        api = self.pools.get("api", {}).get("stages", {})
        seen = [api.get(k, {}).get("count", 0) or 0 for k in ("ttft", "e2e")]
        seen += [p.get("rates", {}).get("routed_per_s", 0) * self.window_s for p in self.pools.values()]
        return float(max(seen, default=0.0))

    @property
    def status(self) -> str:
        """``symptoms``, ``healthy``, ``no_traffic`` or ``too_little_traffic`` (the package docstring,
        :mod:`epd.ops.diagnose`)."""
        if self.symptoms:
            return "symptoms"
        if any(c.status in ("ok", "symptom") for c in self.checks):
            return "healthy"
        return "no_traffic" if self.requests < 0.5 else "too_little_traffic"

    @property
    def healthy(self) -> bool:
        """No symptom and something judged: an idle window is not healthy (see :attr:`status`)."""
        return self.status == "healthy"

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 symptoms, 3 nothing judged (no or too little traffic in the window)."""
        return {"healthy": 0, "symptoms": 1}.get(self.status, 3)

    def to_json(self) -> dict:
        return {"url": self.url, "window_s": self.window_s, "scrapes": self.scrapes, "status": self.status,
                "healthy": self.healthy, "requests": self.requests,
                "symptoms": [c.to_json() for c in self.symptoms],
                "checks": [c.to_json() for c in self.checks], "ignored": list(self.ignored),
                "not_evaluated": [{"id": c.id, "pool": c.pool, "reason": c.detail} for c in self.checks
                                  if c.status == "not_evaluated"],
                "pools": json_safe(self.pools)}

    def format_text(self) -> str:
        """The human report: stage table, pool table, symptoms, then what was fine or not judged."""
        lines = [f"epd diagnose {self.url}: {self.window_s:.1f} s window, {self.scrapes} scrapes", ""]
        lines += _stage_table(self.pools) + [""] + _pool_table(self.pools) + [""]
        if self.symptoms:
            lines.append(f"SYMPTOMS ({len(self.symptoms)})")
            for c in self.symptoms:
                title, cause, fix = SYMPTOMS[c.id]
                lines += [f"  [{c.id}]{' ' + c.pool if c.pool else ''}: {title}", f"    evidence: {c.detail}",
                          f"    cause:    {cause}", f"    fix:      {fix}"]
            lines.append("")
        for status, head in (("ok", "OK"), ("not_evaluated", "NOT EVALUATED"), ("not_applicable", "NOT APPLICABLE")):
            group = [c for c in self.checks if c.status == status or (
                status == "ok" and c.status == "symptom" and c.id in self.ignored)]
            if not group:
                continue
            lines.append(head)
            for c in group:
                tag = f"{c.id}{' (' + c.pool + ')' if c.pool else ''}"
                note = " [ignored symptom]" if c.status == "symptom" else ""
                lines.append(f"  {tag}: {c.detail}{note}")
        verdict = {"healthy": "healthy: no symptom found",
                   "symptoms": f"{len(self.symptoms)} symptom(s) found",
                   "no_traffic": f"no traffic in window: no request in {self.window_s:.1f} s, nothing judged "
                                 "(not healthy, not unhealthy: diagnose a window with traffic)",
                   "too_little_traffic": f"too little traffic in window: {self.requests:.0f} request(s) in "
                                         f"{self.window_s:.1f} s, no check had enough to judge (see NOT EVALUATED)"}
        lines += ["", verdict[self.status]]
        return "\n".join(lines)


def _stage_table(pools: dict[str, dict]) -> list[str]:
    rows = [["pool", "stage", "count", "/s", "mean", "p50", "p95", "p99"]]
    for pool, p in pools.items():
        for name, st in p["stages"].items():
            if not st["count"]:
                continue
            rows.append([pool, name, f"{st['count']:.0f}", f"{st['per_s']:.2f}", ms(st["mean_s"]), ms(st["p50_s"]),
                         ms(st["p95_s"]), ms(st["p99_s"])])
    if len(rows) == 1:
        return ["no stage observed in the window (idle server)"]
    return table(rows, right=set(range(2, 8)))


def _pct(g: dict | None) -> str:
    return "-" if not g else f"{percent(g['mean'])}/{percent(g['max'])}"


def _pool_table(pools: dict[str, dict]) -> list[str]:
    rows = [["pool", "inst", "req/s", "prompt tok/s", "out tok/s", "KV mean/max", "queue mean/max", "running",
             "preempt", "prefix hit (tokens)", "cancelled"]]
    for pool, p in pools.items():
        r, g, c, k = p["rates"], p["gauges"], p["counters"], p["caches"]
        req = r.get("requests_per_s", r.get("routed_per_s"))
        queue = g.get("queue_depth")
        hit = (f"{k['prefix_hit_rate']:.0%} of {k['prefix_query_tokens']:.0f} tok" if "prefix_hit_rate" in k else
               f"enc {k['encoder_hit_rate']:.0%}" if "encoder_hit_rate" in k else "-")
        rows.append([pool, "-" if p["instances"] is None else str(p["instances"]),
                     "-" if req is None else f"{req:.2f}",
                     f"{r['prompt_tokens_per_s']:.0f}" if "prompt_tokens_per_s" in r else "-",
                     f"{r['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in r else "-",
                     _pct(g.get("kv_cache_usage")),
                     "-" if not queue else f"{queue['mean_total']:.1f}/{queue['max']:.0f}",
                     f"{g['running']['mean_total']:.1f}" if "running" in g else
                     f"{g['open_requests']['last']:.0f} open" if "open_requests" in g else "-",
                     f"{c.get('preemptions', 0):.0f}" if pool in ENGINE_POOLS else "-", hit,
                     f"{c['cancelled']:.0f}" if "cancelled" in c else "-"])
    return table(rows, right={1, 2, 3, 4, 7, 8})

