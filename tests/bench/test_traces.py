"""Trace loading and scaling, and trace replay turning prefix hash ids into shared text."""

import json
from pathlib import Path

import numpy as np
import pytest

from epd.bench.runner import schedule
from epd.bench.traces import TraceError, TraceRow, auto_scale, block_tokens, load_trace, scale_trace
from epd.bench.workloads import build_requests, trace_options

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"


def write_mooncake(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_load_mooncake_jsonl(tmp_path):
    p = write_mooncake(tmp_path, [
        {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 2, 3]},
        {"timestamp": 4000, "input_length": 50, "output_length": 5},
    ])
    rows = load_trace(p)
    assert rows == [TraceRow(0.0, 1024, 10, (0, 1)), TraceRow(0.5, 1100, 20, (0, 2, 3)), TraceRow(3.0, 50, 5, ())]
    assert load_trace(p, limit=1, start=1) == [TraceRow(0.0, 1100, 20, (0, 2, 3))]


def test_load_azure_csv(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    rows = load_trace(p)
    assert [(r.input_len, r.output_len) for r in rows] == [(374, 44), (396, 109)]
    assert rows[0].t_s == 0.0 and rows[1].t_s == pytest.approx(4.314579, abs=1e-6)


def test_bad_traces(tmp_path):
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(tmp_path / "x.txt")
    bad = write_mooncake(tmp_path, [{"timestamp": 0, "input_length": 0, "output_length": 3}])
    with pytest.raises(TraceError, match=">= 1"):
        load_trace(bad)
    (tmp_path / "b.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceError, match="not a trace row"):
        load_trace(tmp_path / "b.jsonl")
    (tmp_path / "c.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceError, match="not an Azure trace row"):
        load_trace(tmp_path / "c.csv")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")


def test_scaling_fits_max_model_len():
    rows = [TraceRow(0.0, 12_000, 400), TraceRow(1.0, 60_000, 2_000), TraceRow(2.0, 3_000, 100)]
    assert auto_scale(rows, 8192) == pytest.approx(0.9 * 8192 / 62_000)
    scaled, s = scale_trace(rows, 8192)
    assert max(r.input_len + r.output_len for r in scaled) <= 8192
    assert scaled[1].input_len == round(60_000 * s) and scaled[0].output_len == round(400 * s)
    # explicit scale, then clipped to fit: output shrinks to leave room for the prompt
    clipped, _ = scale_trace([TraceRow(0.0, 900, 500)], 1000, scale=1.0)
    assert clipped[0].input_len == 900 and clipped[0].output_len == 100
    tiny, _ = scale_trace([TraceRow(0.0, 5, 1)], 1000, scale=0.01)
    assert (tiny[0].input_len, tiny[0].output_len) == (1, 1)  # at least one token each
    assert auto_scale([TraceRow(0.0, 10, 10)], 8192) == 1.0  # short traces are not stretched
    assert block_tokens(0.0625) == 32 and block_tokens(0.0001) == 1
    with pytest.raises(TraceError):
        scale_trace(rows, 8192, scale=0.0)


def test_hash_ids_become_shared_prefixes(tmp_path):
    p = write_mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]},
        {"timestamp": 100, "input_length": 1300, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 300, "input_length": 700, "output_length": 64, "hash_ids": [5, 6]},
    ])
    opts, scale = trace_options(p, max_model_len=4096, limit=10, scale=0.125)
    assert scale == 0.125 and opts.trace_block_tokens == 64
    specs = build_requests("trace", 10, opts, seed=0)
    assert len(specs) == 3 and [s.max_tokens for s in specs] == [8, 8, 8]
    a, b, c = (s.messages[0]["content"].split() for s in specs)
    assert [len(a), len(b), len(c)] == [128, round(1300 * 0.125), round(700 * 0.125)]
    assert a == b[:128]  # hash ids 0, 1: the same 2 blocks of 64 words
    assert a[:64] != c[:64]  # different hash ids: different text
    assert [s.arrival_s for s in specs] == [0.0, 0.1, 0.3]
    assert np.allclose(schedule(specs, None, 1.0, 0, speedup=2.0), [0.0, 0.05, 0.15])
    assert np.allclose(schedule(specs, 10.0, 1.0, 0), [0.0, 1 / 15, 0.2])  # mean rate 10 req/s, same shape


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared traces not present")
def test_real_traces_load_and_scale():
    moon = load_trace(SHARED / "mooncake_conversation_trace.jsonl", limit=200)
    assert len(moon) == 200 and all(r.hash_ids for r in moon)
    opts, s = trace_options(SHARED / "mooncake_conversation_trace.jsonl", 8192, 200, None)
    assert max(r.input_len + r.output_len for r in opts.trace_rows) <= 0.9 * 8192
    specs = build_requests("trace", 200, opts)
    firsts = [s.messages[0]["content"].split()[: opts.trace_block_tokens] for s in specs]
    # Mooncake conversations mostly start with hash id 0: those share their first block
    zero = [f for f, r in zip(firsts, opts.trace_rows) if r.hash_ids[0] == 0 and r.input_len >= opts.trace_block_tokens]
    assert len(zero) > 10 and all(f == zero[0] for f in zero)
    azure = load_trace(SHARED / "azure_llm_2023_conv.csv", limit=100)
    assert len(azure) == 100 and azure[-1].t_s > 0


def test_trace_start_skips_the_rows_before_it(tmp_path):
    """`epd bench --trace-start N` replays from row N (as `epd plan recommend --start`): a
    held-out segment of a trace, e.g. to calibrate on rows a plan is not judged on."""
    import argparse

    from epd.bench.cli import add_parser, config_from_args

    p = write_mooncake(tmp_path, [{"timestamp": 100 * i, "input_length": 1000 + 100 * i, "output_length": 64,
                                   "hash_ids": [i]} for i in range(4)])
    opts, _ = trace_options(p, max_model_len=4096, limit=2, scale=0.125, start=1)
    assert [r.input_len for r in opts.trace_rows] == [round(1100 * 0.125), round(1200 * 0.125)]  # rows 1, 2
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["bench", "--workload", "trace", "--trace", str(p), "--trace-start", "1"])
    assert config_from_args(args).trace_start == 1
    with pytest.raises(ValueError, match="trace_start must be >= 0"):
        config_from_args(parser.parse_args(["bench", "--workload", "trace", "--trace", str(p), "--trace-start", "-1"]))
