"""Production request traces for replay: loading and scaling to a small model.

Formats (see ../shared/traces/README.md):

* JSONL, Mooncake (FAST'25) style: one object per line with ``timestamp`` (ms),
  ``input_length``, ``output_length`` and optionally ``hash_ids`` (ids of the prompt's
  512-token prefix blocks; equal ids = the same prefix content, shareable KV).
* CSV, Azure LLM inference trace 2023 (Splitwise, ISCA'24) style: ``TIMESTAMP``
  (``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens``, ``GeneratedTokens``.

Traces hold no text; the workload builder makes synthetic text of the (scaled) lengths
and turns each hash id into one shared block of text, so requests sharing hash ids share
a real prompt prefix.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

#: Mooncake's prefix block: 512 tokens per hash id
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file that cannot be read (missing fields, bad numbers, unknown format)."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One recorded request: arrival ``t_s`` (s from the trace's first row), token counts,
    prefix block ids (empty when the trace has none)."""

    t_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def load_trace(path: str | Path, limit: int | None = None, start: int = 0) -> list[TraceRow]:
    """Rows ``start .. start+limit`` of a ``.jsonl`` (Mooncake) or ``.csv`` (Azure) trace,
    times shifted so the first returned row is at 0 s. Raises TraceError for an unknown
    extension, a missing field or a non-positive length; FileNotFoundError when absent."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise TraceError(f"limit must be >= 1, got {limit}")
    stop = None if limit is None else start + limit
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path, start, stop)
    elif path.suffix == ".csv":
        rows = _read_csv(path, start, stop)
    else:
        raise TraceError(f"{path}: unknown trace format {path.suffix!r} (expected .jsonl or .csv)")
    if not rows:
        raise TraceError(f"{path}: no rows in range start={start} limit={limit}")
    t0 = min(r.t_s for r in rows)
    return [replace(r, t_s=r.t_s - t0) for r in rows]


def _check(path: Path, line: int, inp, out) -> tuple[int, int]:
    try:
        i, o = int(inp), int(out)
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: lengths must be integers, got {inp!r}, {out!r}") from None
    if i < 1 or o < 1:
        raise TraceError(f"{path}:{line}: lengths must be >= 1, got input {i}, output {o}")
    return i, o


def _read_jsonl(path: Path, start: int, stop: int | None) -> list[TraceRow]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f):
            if n < start or not line.strip():
                continue
            if stop is not None and n >= stop:
                break
            try:
                d = json.loads(line)
                t = float(d["timestamp"]) / 1000.0
                i, o = _check(path, n + 1, d["input_length"], d["output_length"])
                hashes = tuple(int(h) for h in d.get("hash_ids") or ())
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                if isinstance(e, TraceError):
                    raise
                raise TraceError(f"{path}:{n + 1}: not a trace row ({type(e).__name__}: {e})") from None
            rows.append(TraceRow(t, i, o, hashes))
    return rows


def _read_csv(path: Path, start: int, stop: int | None) -> list[TraceRow]:
    rows = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for n, d in enumerate(reader):
            if n < start:
                continue
            if stop is not None and n >= stop:
                break
            try:
                stamp = d["TIMESTAMP"]
                date, _, frac = stamp.partition(".")
                t = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))
                i, o = _check(path, n + 2, d["ContextTokens"], d["GeneratedTokens"])
            except (KeyError, ValueError) as e:
                if isinstance(e, TraceError):
                    raise
                raise TraceError(f"{path}:{n + 2}: not an Azure trace row ({type(e).__name__}: {e})") from None
            rows.append(TraceRow(t, i, o))
    return rows


def auto_scale(rows: list[TraceRow], max_model_len: int, fill: float = 0.9) -> float:
    """The length factor that makes the longest row (input + output) fill ``fill`` of
    ``max_model_len``; at most 1 (short traces are not stretched)."""
    longest = max(r.input_len + r.output_len for r in rows)
    return min(1.0, fill * max_model_len / longest)


def scale_trace(rows: list[TraceRow], max_model_len: int, scale: float | None = None) -> tuple[list[TraceRow], float]:
    """Rows with input and output lengths multiplied by ``scale`` (default
    ``auto_scale``), rounded, at least 1 token each, and clipped so input + output fits
    ``max_model_len`` (output first shrinks to leave room). Returns (rows, scale).
    Raises TraceError for ``scale <= 0`` or ``max_model_len < 2``."""
    if max_model_len < 2:
        raise TraceError(f"max_model_len must be >= 2, got {max_model_len}")
    scale = auto_scale(rows, max_model_len) if scale is None else scale
    if not (scale > 0 and math.isfinite(scale)):
        raise TraceError(f"scale must be finite and > 0, got {scale}")
    out = []
    for r in rows:
        i = max(1, round(r.input_len * scale))
        o = max(1, round(r.output_len * scale))
        i = min(i, max_model_len - 1)
        o = min(o, max_model_len - i)
        out.append(replace(r, input_len=i, output_len=o))
    return out, scale


def block_tokens(scale: float, block: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """Tokens of one scaled prefix block (at least 1)."""
    return max(1, round(block * scale))
