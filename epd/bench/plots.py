"""PNG plots of benchmark results (matplotlib, Agg backend): latency CDFs per run and
SLO attainment vs request rate with the goodput point."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itls_s", "ITL"), ("e2e_s", "end-to-end latency"))


def _values(run: dict, key: str) -> np.ndarray:
    vals: list[float] = []
    for r in run["records"]:
        if not r["ok"]:
            continue
        v = r.get(key)
        if isinstance(v, list):
            vals.extend(v)
        elif v is not None:
            vals.append(v)
    return np.sort(np.asarray(vals, dtype=np.float64))


def _label(run: dict, prefix: str = "") -> str:
    return prefix + ("trace" if run["rate"] is None else f"{run['rate']:g} req/s")


def plot_cdfs(results: list[tuple[str, dict]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and e2e (s, log x) of every run of every result
    (``[(name, result dict)]``; the name prefixes the legend when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, _METRICS):
        for name, res in results:
            slo = res["bench"]["slo"].get(key)
            for run in res["runs"]:
                v = _values(run, key)
                if v.size:
                    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post",
                            label=_label(run, f"{name} " if len(results) > 1 else ""))
            if slo:
                ax.axvline(slo, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests" if key != "itls_s" else "fraction of gaps")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attainment(results: list[tuple[str, dict]], path: str | Path) -> Path:
    """SLO attainment (both SLOs; dotted: TTFT only, dashed: TPOT only) against request
    rate for each result, the goodput target line and each goodput point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    target = None
    for name, res in results:
        runs = sorted((r for r in res["runs"] if r["rate"] is not None and np.isfinite(r["rate"])),
                      key=lambda r: r["rate"])
        if not runs:
            continue
        x = [r["rate"] for r in runs]
        both = [r["summary"]["attainment"]["both"] for r in runs]
        (line,) = ax.plot(x, both, "o-", label=f"{name}: both SLOs")
        ax.plot(x, [r["summary"]["attainment"]["ttft"] for r in runs], ":", color=line.get_color(), lw=1,
                label=f"{name}: TTFT only")
        ax.plot(x, [r["summary"]["attainment"]["tpot"] for r in runs], "--", color=line.get_color(), lw=1,
                label=f"{name}: TPOT only")
        g = res.get("goodput")
        if g:
            target = g["target"]
            if g["status"] != "never_met":  # a right-pointing triangle: every swept rate met it (a lower bound)
                ax.plot([g["rate"]], [g["target"]], ">" if g["status"] == "lower_bound" else "*",
                        ms=12 if g["status"] == "lower_bound" else 14, color=line.get_color())
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    slo = results[0][1]["bench"]["slo"] if results else {}
    ax.set_title(f"SLO attainment (TTFT {slo.get('ttft_s')} s, TPOT {slo.get('tpot_s')} s)\n"
                 "* goodput, > goodput at least this (every rate met the target)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
