"""Drive a benchmark: one run per request rate (a rate sweep), each sending its requests
at gamma/Poisson arrival times, bounded in request count and duration; results as a
JSON-ready dict with per-request records, summaries, SLO attainment and goodput."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from epd.bench.arrivals import arrival_times, rescale_to_rate
from epd.bench.client import send_chat, send_voice
from epd.bench.metrics import RequestRecord, goodput, summarize
from epd.bench.workloads import RequestSpec, TextMaker, WorkloadOptions, build_requests, spec_summary


@dataclass
class BenchConfig:
    """One ``epd bench`` invocation. Rates in requests/s (``inf``: all at once); a trace
    replayed without rates keeps its recorded times divided by ``trace_speedup``.
    ``duration_s`` bounds the sending window of each run (requests scheduled later are
    not sent); ``request_timeout_s`` bounds each request; ``max_concurrency`` caps the
    requests in flight (a due request waits for a free slot; its clock starts when sent)."""

    base_url: str
    workload: str = "chat"
    rates: list[float] = field(default_factory=lambda: [1.0])
    cv: float = 1.0
    num_requests: int = 50
    duration_s: float | None = None
    seed: int = 0
    ttft_slo_s: float | None = 2.0
    tpot_slo_s: float | None = 0.1
    goodput_target: float = 0.9
    num_devices: int | None = None
    model: str | None = None
    max_model_len: int | None = None
    options: WorkloadOptions = field(default_factory=WorkloadOptions)
    trace_speedup: float = 1.0
    trace_scale: float | None = None
    trace_start: int = 0
    ignore_eos: bool = True
    include_usage: bool = True
    warmup: int = 1
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    progress: bool = True
    tokens_per_word: float | None = None  # None: calibrated on the served model's tokenizer when it is local

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.rates and self.workload != "trace":
            raise ValueError("give at least one request rate")
        if any(not r > 0 for r in self.rates) or len(set(self.rates)) != len(self.rates):
            raise ValueError(f"rates must be distinct and > 0, got {self.rates}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0 < self.goodput_target <= 1:
            raise ValueError(f"goodput_target must be within (0, 1], got {self.goodput_target}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.trace_start < 0:
            raise ValueError(f"trace_start must be >= 0, got {self.trace_start}")
        if not self.trace_speedup > 0:
            raise ValueError(f"trace_speedup must be > 0, got {self.trace_speedup}")


def api_base(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class _Progress:
    """tqdm when installed, else a line every 10 %."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.done, self._bar = total, desc, enabled, 0, None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"{self.desc}: {self.done}/{self.total} requests done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _discover(cfg: BenchConfig, client) -> tuple[str, int | None, int, str]:
    """(model, max_model_len, devices, where the device count came from) from the server."""
    import httpx

    model, mml = cfg.model, cfg.max_model_len
    if model is None or mml is None:
        try:
            models = await client.models.list()
        except Exception as e:  # openai.APIConnectionError, APIStatusError, ...
            raise RuntimeError(f"cannot list models at {api_base(cfg.base_url)}/models: "
                               f"{type(e).__name__}: {e}") from None
        if not models.data:
            raise RuntimeError(f"{cfg.base_url}: /v1/models lists no model")
        first = models.data[0]
        model = model or first.id
        mml = mml or (first.model_extra or {}).get("max_model_len")
    if cfg.num_devices is not None:
        return model, mml, cfg.num_devices, "given"
    root = api_base(cfg.base_url)[: -len("/v1")]
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.get(root + "/epd/workers")
        if resp.status_code == 200 and isinstance(resp.json(), dict) and resp.json():
            return model, mml, len(resp.json()), "/epd/workers"
    except (httpx.HTTPError, ValueError):
        pass
    return model, mml, 1, "default"


def schedule(specs: list[RequestSpec], rate: float | None, cv: float, seed: int, speedup: float = 1.0) -> np.ndarray:
    """Send times (s) for ``specs``: recorded trace times (rescaled to ``rate`` when given,
    else divided by ``speedup``) or gamma arrivals at ``rate`` with coefficient ``cv``."""
    recorded = [s.arrival_s for s in specs]
    if specs and all(t is not None for t in recorded):
        t = np.asarray(recorded, dtype=np.float64)
        if rate is None:
            return (t - t.min()) / speedup
        if math.isinf(rate):
            return np.zeros(len(t))
        return rescale_to_rate(t, rate)
    if rate is None:
        raise ValueError("synthetic workloads need a request rate")
    return arrival_times(len(specs), rate, cv, seed)


async def drain(tasks: list[asyncio.Task], until: float) -> None:
    """Wait for ``tasks`` until the ``time.perf_counter()`` time ``until``; cancel the rest
    (and wait for them to finish cancelling)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, pending = await asyncio.wait(pending, timeout=max(0.0, until - time.perf_counter()))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def send_open_loop(specs: list[RequestSpec], times: np.ndarray,
                         send: Callable[[RequestSpec, RequestRecord], Awaitable[None]], *,
                         max_concurrency: int | None = None, on_done: Callable[[], None] | None = None,
                         drain_s: float | None = None) -> tuple[list[RequestRecord], float]:
    """Open-loop sender: ``specs[i]`` is due ``times[i]`` seconds (ascending) after the start,
    whether or not earlier requests have finished.

    Each request gets a :class:`RequestRecord` (index ``i``, ``scheduled_s = times[i]``) and is
    handed to ``send(spec, rec)``, a coroutine that fills the record and does not raise for a
    failed request; ``rec.sent_s`` is set (s after the start) when it is sent. At most
    ``max_concurrency`` requests are in flight (``None``: no cap; a due request waits for a
    free slot). ``on_done()`` is called after each request. ``drain_s=None`` waits for every
    request; otherwise requests still running ``drain_s`` seconds after the last due time are
    cancelled. Returns (records in ``specs`` order, the start as ``time.perf_counter()``).
    """
    slots = asyncio.Semaphore(max_concurrency or len(specs))

    async def one(spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        async with slots:
            rec.sent_s = time.perf_counter() - start
            await send(spec, rec)
        if on_done is not None:
            on_done()
        return rec

    start = time.perf_counter()
    tasks, records = [], []
    for i, (spec, t) in enumerate(zip(specs, times)):
        delay = start + float(t) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(i, spec.kind, scheduled_s=float(t), max_tokens=spec.max_tokens,
                            prompt_tokens=spec.prompt_tokens)
        records.append(rec)
        tasks.append(asyncio.create_task(one(spec, rec)))
    if drain_s is None:
        await asyncio.gather(*tasks)
    elif tasks:
        await drain(tasks, start + float(times[len(tasks) - 1]) + drain_s)
    return records, start


async def run_at_rate(cfg: BenchConfig, client, model: str, specs: list[RequestSpec], rate: float | None,
                      seed: int) -> dict:
    """Send ``specs`` at ``rate``; return {"rate", "records", "summary", ...} for one run."""
    times = schedule(specs, rate, cfg.cv, seed, cfg.trace_speedup)
    if cfg.duration_s is not None:
        keep = int(np.searchsorted(times, cfg.duration_s, side="right"))
        specs, times = specs[:max(1, keep)], times[:max(1, keep)]
    label = "inf" if rate is not None and math.isinf(rate) else (f"{rate:g}" if rate is not None else "trace")
    bar = _Progress(len(specs), f"bench {cfg.workload} @ {label} req/s", cfg.progress)

    async def _send(spec: RequestSpec, rec: RequestRecord) -> None:
        send = send_voice(client, model, spec, rec) if spec.kind == "voice" else send_chat(
            client, model, spec, rec, ignore_eos=cfg.ignore_eos, include_usage=cfg.include_usage)
        try:
            await asyncio.wait_for(send, cfg.request_timeout_s)
        except TimeoutError:
            rec.ok, rec.error = False, f"timed out after {cfg.request_timeout_s} s"

    records, start = await send_open_loop(specs, times, _send, max_concurrency=cfg.max_concurrency,
                                          on_done=bar.update)
    bar.close()
    ends = [r.sent_s + r.e2e_s for r in records if r.e2e_s is not None]
    duration = (max(ends) if ends else time.perf_counter() - start) - min(r.sent_s for r in records)
    offered = (len(records) - 1) / float(times[-1]) if len(records) > 1 and times[-1] > 0 else None
    return {"rate": rate, "offered_rate": offered, "workload": spec_summary(specs),
            "summary": summarize(records, duration, cfg.ttft_slo_s, cfg.tpot_slo_s),
            "records": [r.to_json() for r in records]}


def _machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def served_tokens_per_word(model: str) -> tuple[float, str]:
    """Tokens per word of the synthetic text under the tokenizer of ``model`` (the server's
    ``/v1/models`` id) when that names a local model directory or epd's embedded default, as
    vLLM's benchmark defaults ``--tokenizer`` to ``--model``; else 1.0 (a BPE vocabulary's
    usual figure), with a warning on stderr. Returns ``(tokens_per_word, where it came from)``."""
    from epd.bench.workloads import calibrate
    from epd.models.checkpoints import resolve_model

    try:
        path = resolve_model(model)
        from transformers import AutoTokenizer

        return calibrate(AutoTokenizer.from_pretrained(path, local_files_only=True)), str(path)
    except Exception as e:  # any failure leaves the estimate, said on stderr
        print(f"epd bench: synthetic prompts assume 1.0 tokens per word: the served model {model!r} has no local "
              f"tokenizer here ({type(e).__name__}); pass --tokenizer DIR to calibrate them", file=sys.stderr)
        return 1.0, "default"


async def run_bench(cfg: BenchConfig) -> dict:
    """Run every rate of ``cfg`` against the server; return the results dict (JSON-ready):
    ``bench`` (settings, server, machine, load averages), ``runs`` (one per rate) and
    ``goodput`` (DistServe, total and per device). Raises RuntimeError when the server
    cannot be reached or lists no model."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=api_base(cfg.base_url), api_key=os.environ.get("OPENAI_API_KEY", "none"),
                         max_retries=0, timeout=cfg.request_timeout_s)
    try:
        model, mml, devices, devices_from = await _discover(cfg, client)
        opts, scale = cfg.options, None
        if cfg.workload == "trace":
            from epd.bench.workloads import trace_options

            if opts.trace_path is None:
                raise ValueError("the trace workload needs --trace FILE")
            if mml is None:
                raise ValueError("the server does not report max_model_len; pass --max-model-len")
            if not opts.trace_rows:  # (rows a caller chose and scaled itself are replayed as given)
                opts, scale = trace_options(opts.trace_path, mml, cfg.num_requests, cfg.trace_scale, cfg.trace_start)
        per_word, per_word_from = ((cfg.tokens_per_word, "given") if cfg.tokens_per_word is not None
                                   else served_tokens_per_word(model))
        text = TextMaker(per_word)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        load_before = _load()
        for w in range(cfg.warmup):
            wspec = build_requests(cfg.workload if cfg.workload != "trace" else "chat", 1, cfg.options,
                                   seed=cfg.seed + 10_000_019 + w, text=text)[0]
            rec = RequestRecord(-1, "warmup", 0.0)
            if wspec.kind == "voice":
                await send_voice(client, model, wspec, rec)
            else:
                await send_chat(client, model, wspec, rec, ignore_eos=cfg.ignore_eos, include_usage=cfg.include_usage)
            if not rec.ok:
                raise RuntimeError(f"the warm-up request to {cfg.base_url} failed: {rec.error}")
        runs = []
        rates: list[float | None] = list(cfg.rates) or [None]
        for k, rate in enumerate(rates):
            seed = cfg.seed + 7919 * k
            specs = build_requests(cfg.workload, cfg.num_requests, opts, seed=seed, text=text, max_model_len=mml)
            runs.append(await run_at_rate(cfg, client, model, specs, rate, seed))
    finally:
        await client.close()
    out = {"bench": {
        "started_utc": started, "base_url": cfg.base_url, "model": model, "max_model_len": mml,
        "workload": cfg.workload, "options": {k: (str(v) if isinstance(v, Path) else v)
                                              for k, v in asdict(opts).items() if k != "trace_rows"},
        "trace_scale": scale, "rates": cfg.rates, "cv": cfg.cv, "num_requests": cfg.num_requests,
        "tokens_per_word": per_word, "tokens_per_word_from": per_word_from,
        "duration_s": cfg.duration_s, "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "slo": {"ttft_s": cfg.ttft_slo_s, "tpot_s": cfg.tpot_slo_s, "target": cfg.goodput_target},
        "num_devices": devices, "devices_from": devices_from, "machine": _machine(),
        "load_avg_before": load_before, "load_avg_after": _load()},
        "runs": runs}
    sweep = [(r["rate"], r["summary"]["attainment"]["both"]) for r in runs
             if r["rate"] is not None and math.isfinite(r["rate"]) and r["summary"]["attainment"]["both"] is not None]
    if sweep:
        g = goodput([r for r, _ in sweep], [a for _, a in sweep], cfg.goodput_target)
        out["goodput"] = {"rate": g.rate, "status": g.status, "target": g.target,
                          "per_device": g.per_device(devices), "num_devices": devices}
    return out


def format_table(result: dict) -> str:
    """A plain-text table of the runs (latencies in ms)."""
    def ms(d: dict, key: str) -> str:
        v = d.get(key)
        return "-" if v is None else f"{v * 1000:.0f}"

    head = (f"{'rate':>6} {'ok/n':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'ITL p99':>8} {'e2e p99':>8} {'attain':>7} {'out tok/s':>9}")
    lines = [head]
    for run in result["runs"]:
        s = run["summary"]
        rate = "trace" if run["rate"] is None else f"{run['rate']:g}"
        att = s["attainment"]["both"]
        tps = s["output_token_throughput"]
        lines.append(f"{rate:>6} {s['completed']:>3}/{s['requests']:<3} {ms(s['ttft_s'], 'p50'):>9} "
                     f"{ms(s['ttft_s'], 'p99'):>9} {ms(s['tpot_s'], 'p50'):>9} {ms(s['tpot_s'], 'p99'):>9} "
                     f"{ms(s['itl_s'], 'p99'):>8} {ms(s['e2e_s'], 'p99'):>8} "
                     f"{'-' if att is None else f'{att:.0%}':>7} {'-' if tps is None else f'{tps:.1f}':>9}")
    g = result.get("goodput")
    slo = result["bench"]["slo"]
    lines.append(f"latencies in ms; SLOs TTFT {slo['ttft_s']} s, TPOT {slo['tpot_s']} s")
    if g:
        lines.append(f"goodput ({g['target']:.0%} attainment): {g['rate']:.3f} req/s ({g['status']}), "
                     f"{g['per_device']:.3f} req/s per device over {g['num_devices']} devices")
    return "\n".join(lines)
