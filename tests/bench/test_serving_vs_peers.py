"""benchmarks/serving_vs_peers.py without servers: llama-server's slot groups and command,
and the tables' ratio against llamacpp-server at the same dtype."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def svp():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _common
    spec = importlib.util.spec_from_file_location("serving_vs_peers", BENCH / "serving_vs_peers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(BENCH))


def _groups(svp, *argv):
    return [(n, [p.name for p in pts]) for n, pts in svp.slot_groups(svp.make_plan(svp.parse_args(list(argv))))]


def test_slot_groups_give_each_point_its_client_count(svp):
    assert _groups(svp, "--quick") == [(1, ["closed-1"]), (4, ["closed-4", "long-mix", "trace"])]
    assert _groups(svp) == [(1, ["closed-1"]), (8, ["closed-8"]), (32, ["closed-32", "trace"]), (4, ["long-mix"])]
    # the trace gets the full plan's largest client count, also when run alone
    assert _groups(svp, "--points", "trace") == [(32, ["trace"])]


def test_llama_server_command(svp, tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "SmolLM2-135M-Instruct-q8_0.gguf").write_text("")
    args = svp.parse_args(["--llama-server", str(exe), "--gguf-dir", str(gguf_dir), "--out-dir", str(tmp_path)])
    srv = svp.build_server("llamacpp-server", "q8_0", 8123, [0, 1], args, slots=8)
    assert srv.cmd[:4] == ["taskset", "-c", "0,1", str(exe)]
    cmd = srv.cmd[4:]
    assert cmd[cmd.index("-m") + 1] == str(gguf_dir / "SmolLM2-135M-Instruct-q8_0.gguf")
    assert cmd[cmd.index("--parallel") + 1] == "8" and cmd[cmd.index("-c") + 1] == str(8 * 4096)
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"
    assert cmd[cmd.index("--alias") + 1] == "SmolLM2-135M-Instruct" and srv.health_path == "/health"
    assert svp.force_extra("llamacpp-server", 64) == {"ignore_eos": True}
    args.llama_server = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="install.sh"):
        svp.build_server("llamacpp-server", "bf16", 8123, [0], args)


def test_variant_dtypes(svp):
    assert svp.resolved_dtype("llamacpp-server", "bf16") == "bf16"
    assert svp.resolved_dtype("llamacpp-server", "q8_0") == "q8_0"
    assert svp.resolved_dtype("epd-agg", "int8") == "int8"
    assert svp.EPD_FLAGS["int8"] == ["--quantization", "int8"]


def _summary(tok_s):
    return {"completed": 4, "requests": 4, "tok_s": tok_s, "ttft_s": {"p50": 0.1, "p99": 0.2},
            "tpot_s": {"p50": 0.02}, "itl_s": {"p99": 0.03}, "itl_max_s": 0.04, "attainment": {"both": 1.0},
            "exact_length": 1.0, "cpu": {}, "length_control": "x"}


def _entry(system, variant, dtype, tok_s):
    return {"system": system, "variant": variant, "dtype": dtype,
            "points": {"closed-1": {"summary": _summary(tok_s)}}}


def _vs(text, key):
    line = next(ln for ln in text.splitlines() if ln.startswith(key + " "))
    return line.split()[-1]


def test_every_row_is_compared_with_llama_server_at_its_dtype(svp):
    results = {k: _entry(*k.split(":"), d, t) for k, d, t in [
        ("epd-agg:default", "bf16", 30.0), ("epd-agg:fp32", "fp32", 20.0), ("epd-agg:int8", "int8", 45.0),
        ("llamacpp-server:bf16", "bf16", 60.0), ("llamacpp-server:q8_0", "q8_0", 90.0),
        ("llamacpp:q4_1", "q4_1", 50.0)]}
    saved = {"bench": {"duration_s": 5.0}, "results": results}
    text = svp.tables(saved)
    assert _vs(text, "epd-agg:default") == "0.50x"  # bf16 / llama-server bf16
    assert _vs(text, "epd-agg:int8") == "0.50x"  # int8 / llama-server q8_0
    assert _vs(text, "llamacpp-server:q8_0") == "1.00x"
    assert _vs(text, "epd-agg:fp32") == "-" and _vs(text, "llamacpp:q4_1") == "-"  # no such llama-server
    assert "| closed-1 | epd-agg:int8 (int8) | llamacpp-server:q8_0 (q8_0) | both 8-bit | 0.50x |" in text
    assert "| closed-1 | epd-agg:default (bf16) | llamacpp-server:bf16 (bf16) | own defaults | 0.50x |" in text
    # without the peer in the results, every row says "-"
    for k in ("llamacpp-server:bf16", "llamacpp-server:q8_0"):
        del results[k]
    text = svp.tables(saved)
    assert all(_vs(text, k) == "-" for k in results)
