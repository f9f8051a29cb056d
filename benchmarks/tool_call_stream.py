"""Streaming tool-call parsing: the API's CPU time per token as a call's arguments grow.

The API parses a tool-calling stream on its event loop, token by token
(``epd.api.tool_parsers``): work that grows with the open call's length makes a long call
quadratic and stalls every other stream and heartbeat on that loop. This feeds one call
(``hermes``, ``mistral`` and ``llama3_json`` formats) with ``--chars`` characters of
arguments to the parser in ``--chunk``-character tokens and reports, per argument length,
the mean and max time of a token in the last 1,000 tokens of the call (where a rescan
costs most) and the whole call's parse time. ``--ref REV`` runs the parser of a git
revision beside this checkout's, in the same process (its ``tool_parsers.py`` loaded from
``git show``), so the two are measured side by side.

    python benchmarks/tool_call_stream.py --ref 18c0506

Results go to benchmarks/results/tool_call_stream.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, git_commit, load_avg

from epd.api import tool_parsers

FORMATS = {"hermes": "HermesParser", "mistral": "MistralParser", "llama3_json": "Llama3JsonParser"}


def load_ref(rev: str):
    """``epd/api/tool_parsers.py`` as it was at ``rev``, as a module."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:epd/api/tool_parsers.py"], capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "tool_parsers_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tool_parsers_ref", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def arguments(chars: int) -> str:
    """A JSON object of about ``chars`` characters: one ``code`` string of Python lines."""
    line = "print('hello, world')  # a line of the program\\n"
    return json.dumps({"code": line * max(1, chars // len(line))})


def run(mod, fmt: str, chars: int, chunk: int) -> dict:
    """One call of ``chars`` argument characters through ``mod``'s parser for ``fmt``:
    ``tail_mean_us`` / ``tail_max_us`` per token over the call's last 1,000 tokens, ``total_ms``."""
    cls = getattr(mod, FORMATS[fmt])
    text = cls.format_calls([("run_code", arguments(chars))])
    parser, times, got = cls(), [], ""
    t_all = time.perf_counter()
    for k in range(0, len(text), chunk):
        t = time.perf_counter()
        out = parser.feed(text[k:k + chunk])
        times.append(time.perf_counter() - t)
        got += "".join(d.arguments or "" for d in out.calls)
    got += "".join(d.arguments or "" for d in parser.finish().calls)
    total = time.perf_counter() - t_all
    assert json.loads(got) == json.loads(arguments(chars)), f"{fmt} {chars}: wrong arguments streamed"
    tail = times[-1000:]
    return {"tail_mean_us": 1e6 * sum(tail) / len(tail), "tail_max_us": 1e6 * max(tail), "total_ms": 1e3 * total,
            "tokens": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[1_000, 10_000, 30_000, 100_000])
    ap.add_argument("--chunk", type=int, default=4, help="characters per token [4]")
    ap.add_argument("--ref", help="a git revision whose parser runs beside this one")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tool_call_stream.json"))
    args = ap.parse_args()
    parsers = {"this": tool_parsers}
    if args.ref:
        parsers[args.ref] = load_ref(args.ref)
    rows, load0 = [], load_avg()
    print(f"{'format':<12} {'args chars':>10} " + " ".join(f"{n + ' us/token (tail mean/max)':>34} {'call ms':>9}"
                                                      for n in parsers))
    for fmt in FORMATS:
        for chars in args.chars:
            res = {name: run(mod, fmt, chars, args.chunk) for name, mod in parsers.items()}
            rows.append({"format": fmt, "chars": chars, **res})
            print(f"{fmt:<12} {chars:>10} " + " ".join(
                f"{r['tail_mean_us']:>24.1f} / {r['tail_max_us']:>7.1f} {r['total_ms']:>9.1f}" for r in res.values()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"commit": git_commit(), "ref": args.ref, "chunk": args.chunk,
                                          "load_avg": [load0, load_avg()], "python": sys.version.split()[0],
                                          "rows": rows}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
