"""``epd launch --pools/--tp`` parsing and validation (pure functions, no processes)."""

from __future__ import annotations

import pytest

from epd.launch.spec import LaunchSpecError, PoolSpec, build_launch_plan, parse_pools, parse_tp

# SmolLM2-135M: 9 attention heads, 3 KV heads
SMOL = dict(num_attention_heads=9, num_kv_heads=3)
# a Llama-like model with 32 heads, 8 KV heads
BIG = dict(num_attention_heads=32, num_kv_heads=8)


# ---------------------------------------------------------------- valid specs
@pytest.mark.parametrize("text, expected", [
    ("e:2,p:4,d:8", {"encode": 2, "prefill": 4, "decode": 8}),
    ("e:1,pd:2", {"encode": 1, "pd": 2}),
    ("p:1,d:1", {"prefill": 1, "decode": 1}),
    ("e:0,p:1,d:1", {"prefill": 1, "decode": 1}),
    ("pd:1", {"pd": 1}),
    (" E : 1 , P:2 ,d:3 ", {"encode": 1, "prefill": 2, "decode": 3}),
    ("encode:1,prefill:2,decode:3", {"encode": 1, "prefill": 2, "decode": 3}),
    ("d:3,p:2,e:1", {"encode": 1, "prefill": 2, "decode": 3}),
])
def test_parse_pools_valid(text, expected):
    got = parse_pools(text)
    assert got == expected
    assert list(got) == list(expected)  # launch order: encode, prefill, decode, pd


def test_parse_pools_launch_order_is_canonical():
    assert list(parse_pools("d:1,e:1,p:1")) == ["encode", "prefill", "decode"]


def test_parse_tp_defaults_to_one():
    pools = parse_pools("e:2,p:4,d:8")
    assert parse_tp(None, pools) == {"encode": 1, "prefill": 1, "decode": 1}
    assert parse_tp("", pools) == {"encode": 1, "prefill": 1, "decode": 1}
    assert parse_tp("p:4", pools) == {"encode": 1, "prefill": 4, "decode": 1}
    assert parse_tp("pd:2", parse_pools("pd:4")) == {"pd": 2}


def test_plan_example_of_design():
    plan = build_launch_plan("e:2,p:4,d:8", "p:4,d:1", **BIG)
    assert plan == [PoolSpec("encode", 2, 1), PoolSpec("prefill", 4, 4), PoolSpec("decode", 8, 1)]
    assert [p.instances for p in plan] == [2, 1, 8]
    assert plan[1].instance_ids() == ["prefill-0"]
    assert plan[2].instance_ids() == [f"decode-{i}" for i in range(8)]


def test_plan_aggregated_and_default():
    assert build_launch_plan("e:1,p:1,d:1", None, **SMOL) == [
        PoolSpec("encode", 1, 1), PoolSpec("prefill", 1, 1), PoolSpec("decode", 1, 1)]
    plan = build_launch_plan("e:1,pd:6", "pd:3", **SMOL)
    assert plan == [PoolSpec("encode", 1, 1), PoolSpec("pd", 6, 3)]
    assert plan[1].instances == 2


def test_plan_without_kv_heads_means_mha():
    assert build_launch_plan("p:2,d:2", "p:2,d:2", num_attention_heads=4)[0].tp == 2
    with pytest.raises(LaunchSpecError, match="3 attention heads and 3 KV heads"):
        build_launch_plan("p:2,d:2", "p:2", num_attention_heads=3)


# ---------------------------------------------------------------- invalid --pools
@pytest.mark.parametrize("text, words", [
    ("", ["empty", "e:2,p:4,d:8"]),
    ("   ", ["empty"]),
    ("e:1,p:1,d:1,", ["empty entry", "e:2,p:4,d:8"]),
    ("e:1,,p:1,d:1", ["empty entry"]),
    ("e1,p:1,d:1", ["'e1'", "ROLE:COUNT"]),
    ("e=1,p:1,d:1", ["ROLE:COUNT"]),
    ("e:1:2,p:1,d:1", ["ROLE:COUNT"]),
    ("x:1,p:1,d:1", ["unknown role 'x'", "pd (aggregated"]),
    ("gpu:1", ["unknown role 'gpu'"]),
    ("e:two,p:1,d:1", ["'two' is not a whole number", "e:2,p:4,d:8"]),
    ("e:1.5,p:1,d:1", ["'1.5' is not a whole number"]),
    ("e:-1,p:1,d:1", ["'-1' is not a whole number"]),
    ("e:,p:1,d:1", ["'' is not a whole number"]),
    ("e:1,p:0,d:1", ["prefill pool needs at least 1 device", "encode and tts pools may be 0"]),
    ("pd:0", ["pd pool needs at least 1"]),
    ("e:1,p:1,d:1,p:2", ["prefill pool twice"]),
    ("e:1,encode:2,p:1,d:1", ["encode pool twice"]),
    ("e:1,pd:2,p:1", ["mixes an aggregated pd pool", "e:1,pd:2"]),
    ("pd:2,d:1", ["mixes an aggregated pd pool"]),
    ("e:1,p:1", ["no d pool", "e:1,p:1,d:1"]),
    ("e:1,d:4", ["no p pool"]),
    ("e:2", ["no p and no d pool"]),
    ("e:0", ["no p and no d pool"]),
])
def test_parse_pools_invalid(text, words):
    with pytest.raises(LaunchSpecError) as ei:
        parse_pools(text)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "e.g." in msg or "(e.g." in msg  # every message shows a valid example


def test_launch_spec_error_is_value_error():
    assert issubclass(LaunchSpecError, ValueError)


# ---------------------------------------------------------------- invalid --tp
@pytest.mark.parametrize("pools, tp, words", [
    ("e:2,p:4,d:8", "e:2", ["encode pool has no tensor parallelism", "p:4,d:1"]),
    ("e:2,p:4,d:8", "p:4,encode:1", ["encode pool has no tensor parallelism"]),
    ("e:2,p:4,d:8", "p:3", ["TP 3 does not divide the 4 devices of the prefill pool", "1, 2, 4"]),
    ("e:2,p:4,d:8", "p:4,d:3", ["TP 3 does not divide the 8 devices of the decode pool", "1, 2, 4, 8"]),
    ("e:1,pd:2", "pd:4", ["TP 4 does not divide the 2 devices of the pd pool"]),
    ("e:2,p:4,d:8", "pd:2", ["has no pd pool"]),
    ("e:1,pd:2", "p:2", ["has no prefill pool"]),
    ("e:2,p:4,d:8", "p:0", ["at least 1"]),
    ("e:2,p:4,d:8", "p:x", ["'x' is not a whole number"]),
    ("e:2,p:4,d:8", "p:2,p:4", ["prefill pool twice"]),
    ("e:2,p:4,d:8", "p4", ["ROLE:COUNT", "p:4,d:1"]),
    ("e:2,p:4,d:8", "q:2", ["unknown role 'q'"]),
    ("e:2,p:4,d:8", "p:2,", ["empty entry"]),
])
def test_parse_tp_invalid(pools, tp, words):
    with pytest.raises(LaunchSpecError) as ei:
        parse_tp(tp, parse_pools(pools))
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


def test_tp_must_divide_model_heads_and_message_names_them():
    # SmolLM2: 9 heads, 3 KV heads -> TP 2 and 4 impossible, 3 fine
    with pytest.raises(LaunchSpecError) as ei:
        build_launch_plan("e:1,p:2,d:1", "p:2", **SMOL)
    msg = str(ei.value)
    assert "p:2" in msg and "9 attention heads" in msg and "3 KV heads" in msg and "1, 3" in msg
    with pytest.raises(LaunchSpecError, match="32 attention heads and 8 KV heads"):
        build_launch_plan("p:16,d:16", "p:16", **BIG)
    with pytest.raises(LaunchSpecError, match="d:4"):
        build_launch_plan("p:1,d:4", "d:4", **SMOL)
    assert build_launch_plan("p:3,d:3", "p:3,d:3", **SMOL)[0].instances == 1


def test_build_plan_reports_spec_errors_before_model_errors():
    with pytest.raises(LaunchSpecError, match="mixes an aggregated"):
        build_launch_plan("p:1,pd:1", None, **SMOL)
    with pytest.raises(LaunchSpecError, match="encode pool has no tensor parallelism"):
        build_launch_plan("e:2,p:1,d:1", "e:2", **SMOL)


def test_launch_refuses_bad_engine_settings_before_starting_workers():
    """A negative stall-free cap or an unknown dtype fails `epd launch` at once (LaunchConfig),
    not in every worker it would start; the given ones are forwarded, switches as flags."""
    from epd.launch.config import LaunchConfig

    with pytest.raises(LaunchSpecError, match="max_prefill_tokens_with_decodes must be >= 0"):
        LaunchConfig(max_prefill_tokens_with_decodes=-5)
    with pytest.raises(LaunchSpecError, match="dtype must be one of"):
        LaunchConfig(dtype="fp8")
    with pytest.raises(LaunchSpecError, match=r"tts_engine: unknown TTS engine .espek.: use one of .espeak."):
        LaunchConfig(tts_engine="espek")  # else each tts worker dies at start-up, and the launch with it
    assert LaunchConfig(tts_engine="espeak").forwarded_worker_args() == ["--tts-engine", "espeak"]
    args = LaunchConfig(max_prefill_tokens_with_decodes=0, dtype="float32", compile=True,
                        cuda_graph_sizes=(1, 2, 4)).forwarded_worker_args()
    assert args == ["--max-prefill-tokens-with-decodes", "0", "--dtype", "float32", "--compile",
                    "--cuda-graph-sizes", "1,2,4"]
    assert LaunchConfig().forwarded_worker_args() == []


@pytest.mark.parametrize("gb", [0.0, -1.0, float("nan"), float("inf")])
def test_launch_refuses_a_kv_cache_size_that_is_not_positive(gb, capsys):
    """`--kv-cache-memory-gb 0` / `-1` fails `epd launch` at once with a message naming the flag's
    field (like `--kv-staging-mb 0`), not "worker died during start-up" in every worker it starts."""
    from epd.cli import main
    from epd.launch.config import LaunchConfig

    with pytest.raises(LaunchSpecError, match="kv_cache_memory_gb must be a finite number > 0"):
        LaunchConfig(kv_cache_memory_gb=gb)
    assert main(["launch", "--pools", "p:1,d:1", "--kv-cache-memory-gb", str(gb)]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_memory_gb must be a finite number > 0" in err and "died" not in err
    assert LaunchConfig(kv_cache_memory_gb=0.25).forwarded_worker_args() == ["--kv-cache-memory-gb", "0.25"]


@pytest.mark.parametrize("field", ["num_kv_blocks", "max_model_len"])
def test_launch_refuses_a_block_count_or_model_length_below_one(field):
    from epd.launch.config import LaunchConfig

    with pytest.raises(LaunchSpecError, match=f"{field} must be >= 1, got 0"):
        LaunchConfig(**{field: 0})


def test_launch_refuses_a_staging_pool_smaller_than_one_block(tmp_path, monkeypatch, capsys):
    """With heterogeneous TP, a --kv-staging-mb that holds no staging block (8-layer tiny Llama,
    blocks of 1024 tokens: 2 MiB each) fails `epd launch` at once with the size to use; one that
    holds a few blocks warns that max_model_len is lowered. No worker is started either way."""
    import epd.launch.api_process
    from epd.cli import main
    from epd.models.tiny import create_tiny_model

    calls = []
    monkeypatch.setattr(epd.launch.api_process, "serve", lambda *a, **k: calls.append(k["worker_args"]))
    monkeypatch.setattr("asyncio.run", lambda coro: 0)
    path = str(create_tiny_model("llama", tmp_path / "llama8", num_hidden_layers=8))
    base = ["launch", "--model", path, "--pools", "p:2,d:1", "--tp", "p:2,d:1", "--port", "0"]
    assert main([*base, "--kv-staging-mb", "1", "--block-size", "1024", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "--kv-staging-mb 1 holds no KV staging block" in err and "2.00 MiB" in err, err
    assert "use --kv-staging-mb 2 or more" in err and not calls
    assert main([*base, "--kv-staging-mb", "1", "--block-size", "8", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "holds 64 staging blocks = 512 tokens < max_model_len 2048: max_model_len lowered to 512" in err, err
    assert "--kv-staging-mb" in calls[0]
    # `epd worker --kv-staging-mb` (workers joining `epd serve`) refuses it too, not one block over budget
    from epd.config import ConfigError, EngineConfig
    from epd.workers.engine_worker import EngineWorker

    with pytest.raises(ConfigError, match="--kv-staging-mb 1 holds no KV staging block.*use --kv-staging-mb 2"):
        EngineWorker.staging_blocks(EngineConfig(path, block_size=1024, dtype="float32"), 1)
    assert EngineWorker.staging_blocks(EngineConfig(path, block_size=8, dtype="float32"), 1) == 64
    assert EngineWorker.staging_blocks(EngineConfig(path, block_size=8, dtype="float32"), 0) == 0


def test_quantization_flows_from_launch_to_each_workers_engine_config(tmp_path, monkeypatch):
    """`epd launch --quantization int8` forwards the flag to every worker; `epd worker
    --quantization int8` hands it to the engine's config (EngineWorker builds
    ``EngineConfig(model, **engine_kwargs)``); anything but int8 is refused, naming it."""
    import epd.launch.api_process
    import epd.workers
    from epd.cli import main
    from epd.cli.main import build_parser
    from epd.cli.worker import cmd_worker
    from epd.config import EngineConfig
    from epd.launch.config import LaunchConfig
    from epd.models.tiny import create_tiny_model

    path = str(create_tiny_model("llama", tmp_path / "llama"))
    with pytest.raises(LaunchSpecError, match=r"quantization must be one of \('int8',\).*got 'int4'"):
        LaunchConfig(quantization="int4")
    assert LaunchConfig(quantization="int8").forwarded_worker_args() == ["--quantization", "int8"]
    calls = []
    monkeypatch.setattr(epd.launch.api_process, "serve", lambda *a, **k: calls.append(k["worker_args"]))
    monkeypatch.setattr("asyncio.run", lambda coro: 0)
    assert main(["launch", "--model", path, "--pools", "pd:1", "--port", "0", "--quantization", "int8"]) == 0
    assert calls[0][calls[0].index("--quantization") + 1] == "int8"

    started = []
    monkeypatch.setattr(epd.workers, "run_worker", lambda args: started.append(args) or 0)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # cmd_worker sets it; restored after the test
    for role, want in (("pd", "int8"), ("decode", "int8"), ("encode", None)):
        args = build_parser().parse_args(["worker", "--role", role, "--instance-id", "w0", "--router",
                                          "tcp://127.0.0.1:1", "--model", path, *calls[0]])
        args.early_signals = []
        assert cmd_worker(args) == 0
        kwargs = started[-1].engine_kwargs
        assert kwargs.get("quantization") == want  # encoders run no engine: no engine settings
        if want:
            assert EngineConfig(path, **kwargs).quantization == "int8"
    args = build_parser().parse_args(["worker", "--role", "pd", "--instance-id", "w0", "--router", "tcp://h:1"])
    assert args.quantization is None
