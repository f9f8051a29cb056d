"""The ``epd launch`` process supervisor and the multiprocess metrics, with dummy workers.

Children here are tiny ``python -c`` programs (``Launcher(worker_cmd=...)``), so the
supervisor is tested without model weights: layout, stop/kill escalation, no orphans
after ``stop()`` or after the launcher itself is SIGKILLed (PR_SET_PDEATHSIG), and
metrics summed over processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from epd.launch.ports import check_port_free, find_free_port
from epd.launch.spec import LaunchSpecError, PoolSpec, build_launch_plan
from epd.launch.supervisor import Launcher, default_threads_per_worker, worker_argv

psutil = pytest.importorskip("psutil")

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def _alive(pid: int) -> bool:
    """Running and not a zombie (a reparented child's zombie may linger until init reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(cond, timeout: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def _launcher(plan, **kw) -> Launcher:
    kw.setdefault("worker_cmd", SLEEP)
    return Launcher(plan, model="m", router_endpoint="tcp://127.0.0.1:1", threads_per_worker=1, **kw)


# ---------------------------------------------------------------- ports, threads
def test_check_port_free_detects_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchSpecError) as ei:
            check_port_free("127.0.0.1", port)
        assert str(ei.value) == f"port {port} on 127.0.0.1 is already in use: pick another with --port"
    check_port_free("127.0.0.1", port)  # released: free again
    check_port_free("127.0.0.1", 0)


def test_check_port_free_bad_host_and_port():
    with pytest.raises(LaunchSpecError, match="out of range"):
        check_port_free("127.0.0.1", 70000)
    with pytest.raises(LaunchSpecError, match="--host"):
        check_port_free("no-such-host.invalid", 8000)


def test_host_tier_is_refused_with_tp_before_any_worker_starts():
    from epd.launch.config import LaunchConfig

    with pytest.raises(LaunchSpecError, match="--kv-host-cache-gb .* needs TP 1 in every pool"):
        LaunchConfig(pools="p:3,d:1", tp="p:3,d:1", kv_host_cache_gb=1.0)
    with pytest.raises(LaunchSpecError, match="finite number >= 0"):
        LaunchConfig(kv_host_cache_gb=-1.0)
    assert "--kv-host-cache-gb" in LaunchConfig(pools="p:2,d:1", kv_host_cache_gb=0.5).forwarded_worker_args()


def test_disk_tier_is_refused_without_its_size_or_the_host_tier(tmp_path):
    from epd.launch.config import LaunchConfig

    for kwargs in ({"kv_disk_cache_dir": str(tmp_path), "kv_disk_cache_gb": 1.0},  # no host tier
                   {"kv_host_cache_gb": 1.0, "kv_disk_cache_dir": str(tmp_path)},  # no size
                   {"kv_host_cache_gb": 1.0, "kv_disk_cache_gb": 1.0},  # no directory
                   {"kv_host_cache_gb": 1.0, "kv_disk_cache_dir": str(tmp_path), "kv_disk_cache_gb": float("nan")},
                   {"kv_host_cache_gb": 1.0, "kv_disk_cache_dir": str(tmp_path), "kv_disk_cache_gb": -1.0}):
        with pytest.raises(LaunchSpecError, match="disk tier needs --kv-disk-cache-dir"):
            LaunchConfig(**kwargs)
    with pytest.raises(LaunchSpecError, match="--kv-disk-cache-dir .*: no such directory"):  # before any worker starts
        LaunchConfig(kv_host_cache_gb=1.0, kv_disk_cache_dir=str(tmp_path / "missing"), kv_disk_cache_gb=1.0)
    args = LaunchConfig(kv_host_cache_gb=1.0, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=2.0)
    forwarded = args.forwarded_worker_args()
    assert forwarded[forwarded.index("--kv-disk-cache-dir") + 1] == str(tmp_path)
    assert forwarded[forwarded.index("--kv-disk-cache-gb") + 1] == "2.0"


def test_find_free_port():
    port = find_free_port()
    assert 0 < port < 65536
    check_port_free("127.0.0.1", port)


def test_default_threads_per_worker(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_threads_per_worker(3) == 5
    assert default_threads_per_worker(16) == 1
    assert default_threads_per_worker(40) == 1
    assert default_threads_per_worker(0) == 16


# ---------------------------------------------------------------- layout and argv
def test_layout_of_design_example():
    plan = build_launch_plan("e:2,p:4,d:8", "p:4,d:1", num_attention_heads=32, num_kv_heads=8)
    la = Launcher(plan, model="/models/x", router_endpoint="tcp://127.0.0.1:5555", threads_per_worker=None)
    layout = [(s.role, s.instance_id, s.tp) for s in la.slots]  # one process per instance: its rank 0
    assert layout == ([("encode", f"encode-{i}", 1) for i in range(2)]
                      + [("prefill", "prefill-0", 4)]
                      + [("decode", f"decode-{i}", 1) for i in range(8)])
    assert [s.device_index for s in la.slots] == [0, 1, 2, *range(6, 14)]
    assert la.num_processes == 11
    assert la.threads_per_worker is None  # the thread budget for single-rank workers
    argv = la._argv(la.slots[2])
    assert argv == [sys.executable, "-m", "epd.cli", "worker", "--role", "prefill", "--instance-id", "prefill-0",
                    "--rank", "0", "--tp", "4", "--router", "tcp://127.0.0.1:5555", "--model", "/models/x",
                    "--threads", str(default_threads_per_worker(14))]  # TP ranks: a fixed even share of 14 devices
    assert "--threads" not in la._argv(la.slots[0]) and "--threads" not in la._argv(la.slots[-1])
    fixed = Launcher(plan, model="/models/x", router_endpoint="tcp://127.0.0.1:5555", threads_per_worker=3)
    assert fixed._argv(fixed.slots[0])[-2:] == ["--threads", "3"]


def test_worker_argv_extra_and_no_model():
    argv = worker_argv("pd", "pd-1", 0, 2, router_endpoint="ipc:///tmp/r", model=None, threads=3,
                       extra=["--block-size", "32"])
    assert "--model" not in argv
    assert argv[-4:] == ["--threads", "3", "--block-size", "32"]


def test_children_get_argv_and_env(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = textwrap.dedent(f"""
        import json, os, sys
        keys = ["EPD_INSTANCE_ID", "EPD_RANK", "EPD_DEVICE_INDEX", "OMP_NUM_THREADS", "EPD_LAUNCHER_PID", "FOO"]
        env = {{k: os.environ.get(k) for k in keys}}
        p = os.path.join({str(out)!r}, env["EPD_INSTANCE_ID"] + "-" + env["EPD_RANK"] + ".json")
        json.dump({{"argv": sys.argv[1:], "env": env}}, open(p, "w"))
    """)

    def cmd(role, instance_id, rank, tp):
        return [sys.executable, "-c", code, role, instance_id, str(rank), str(tp)]

    plan = [PoolSpec("encode", 1, 1), PoolSpec("prefill", 2, 2), PoolSpec("decode", 2, 1)]
    la = Launcher(plan, model="m", router_endpoint="tcp://x", threads_per_worker=2, worker_cmd=cmd,
                  env={**os.environ, "FOO": "bar"})
    la.start()
    assert _wait_until(lambda: all(w.popen.poll() is not None for w in la.workers), timeout=20)
    dead = la.poll_dead()
    assert sorted(w.instance_id + str(w.rank) for w in dead) == ["decode-00", "decode-10", "encode-00",
                                                                  "prefill-00"]
    assert all(w.returncode == 0 for w in dead)
    assert la.poll_dead() == []  # each reported once
    got = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    assert got["prefill-0-0"]["argv"] == ["prefill", "prefill-0", "0", "2"]
    assert got["prefill-0-0"]["env"] == {"EPD_INSTANCE_ID": "prefill-0", "EPD_RANK": "0", "EPD_DEVICE_INDEX": "1",
                                         "OMP_NUM_THREADS": "2", "EPD_LAUNCHER_PID": str(os.getpid()),
                                         "FOO": "bar"}
    la.stop()


# ---------------------------------------------------------------- stop, poll, restart
def test_stop_leaves_no_child_alive():
    la = _launcher([PoolSpec("encode", 1, 1), PoolSpec("prefill", 2, 2), PoolSpec("decode", 2, 1)])
    la.start()
    pids = [w.pid for w in la.workers]
    assert len(pids) == 4 and all(_alive(p) for p in pids)
    t0 = time.monotonic()
    la.stop(timeout_s=10)
    assert time.monotonic() - t0 < 5  # SIGTERM kills the sleepers at once
    assert not any(_alive(p) for p in pids)
    assert all(w.returncode == -signal.SIGTERM for w in la.workers)
    for p in pids:  # reaped, not zombies
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)
    la.stop()  # idempotent
    assert la.stopped
    with pytest.raises(RuntimeError):
        la.start()


def test_stop_kills_child_that_ignores_sigterm(tmp_path):
    marker = tmp_path / "ready"
    code = (f"import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(marker)!r}).touch(); time.sleep(60)")
    la = _launcher([PoolSpec("pd", 1, 1)], worker_cmd=[sys.executable, "-c", code])
    la.start()
    assert _wait_until(marker.exists, timeout=10)
    pid = la.workers[0].pid
    t0 = time.monotonic()
    la.stop(timeout_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert la.workers[0].returncode == -signal.SIGKILL
    assert not _alive(pid)
    assert "killed by SIGKILL" in la.workers[0].describe()


def test_stop_kills_grandchildren(tmp_path):
    pidfile = tmp_path / "grandchild"
    code = textwrap.dedent(f"""
        import signal, subprocess, sys, time, pathlib
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # exits without its child
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))
        time.sleep(60)
    """)
    la = _launcher([PoolSpec("pd", 1, 1)], worker_cmd=[sys.executable, "-c", code])
    la.start()
    assert _wait_until(lambda: pidfile.exists() and pidfile.read_text(), timeout=10)
    gpid = int(pidfile.read_text())
    assert _alive(gpid)
    la.stop(timeout_s=5)
    assert _wait_until(lambda: not _alive(gpid), timeout=5)


def test_poll_dead_reports_exit_and_restart():
    code = "import os, sys, time; sys.exit(3) if os.environ['EPD_INSTANCE_ID'] == 'decode-1' else time.sleep(60)"
    la = _launcher([PoolSpec("prefill", 1, 1), PoolSpec("decode", 2, 1)], worker_cmd=[sys.executable, "-c", code])
    la.start()
    try:
        dead = []
        assert _wait_until(lambda: bool(dead.extend(la.poll_dead()) or dead), timeout=10)
        assert [(w.instance_id, w.returncode) for w in dead] == [("decode-1", 3)]
        assert "decode-1 rank 0" in dead[0].describe() and "exited with status 3" in dead[0].describe()
        assert la.poll_dead() == []
        assert len(la.live_workers()) == 2
        new = la.restart(dead[0])
        assert new.instance_id == "decode-1" and new.argv == dead[0].argv and new.pid != dead[0].pid
        with pytest.raises(RuntimeError, match="still running"):
            la.restart(la.workers[0])
    finally:
        la.stop()
    assert not la.live_workers()


def test_children_ignore_sigint():
    la = _launcher([PoolSpec("pd", 1, 1)])
    la.start()
    try:
        pid = la.workers[0].pid
        time.sleep(0.3)  # let the child's interpreter start
        os.kill(pid, signal.SIGINT)  # what a terminal Ctrl-C sends to the whole process group
        time.sleep(0.3)
        assert la.workers[0].popen.poll() is None
    finally:
        la.stop()


# ---------------------------------------------------------------- the launcher process dies
_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from epd.launch.spec import PoolSpec
    from epd.launch.supervisor import Launcher

    la = Launcher([PoolSpec("encode", 1, 1), PoolSpec("prefill", 2, 2), PoolSpec("decode", 1, 1)],
                  model="m", router_endpoint="tcp://127.0.0.1:1", threads_per_worker=1,
                  worker_cmd=[sys.executable, "-c", "import time; time.sleep(60)"])
    def on_stop():
        la.stop(timeout_s=5)
        print("stopped", flush=True)
        sys.exit(0)
    la.install_signal_handlers(on_stop)
    la.start()
    print(json.dumps([w.pid for w in la.workers]), flush=True)
    time.sleep(60)
""")


def _start_script() -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    pids = json.loads(line)
    assert len(pids) == 3
    return proc, pids


@linux_only
def test_sigkilled_launcher_leaves_no_orphans():
    proc, pids = _start_script()
    try:
        assert all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(timeout=10)
        assert _wait_until(lambda: not any(_alive(p) for p in pids), timeout=5), \
            [p for p in pids if _alive(p)]
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_workers(sig):
    proc, pids = _start_script()
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0
        assert "stopped" in out
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


# ---------------------------------------------------------------- metrics over processes
def _metrics_child(instance: str, n_bytes: int, queue_depth: float) -> None:
    from epd import metrics

    m = metrics.get_metrics()
    m.kv_transfer_bytes.labels(pool="prefill", instance="prefill-0").inc(n_bytes)
    m.prefix_cache_queries_tokens.labels(pool="prefill", instance="prefill-0").inc(100)
    m.prefix_cache_hits_tokens.labels(pool="prefill", instance="prefill-0", tier="device").inc(25)
    m.encoder_cache_hits.labels(pool="encode", instance="encode-0").inc()
    m.kv_transfer.labels(pool="prefill", instance="prefill-0").observe(0.003)
    m.time_to_first_token.labels(pool="decode", instance=instance).observe(0.4)
    m.queue_depth.labels(pool="decode", instance="decode-0").set(queue_depth)
    m.running_requests.labels(pool="decode", instance=instance).set(queue_depth + 1)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_summed_over_processes(tmp_path, monkeypatch):
    from epd import metrics

    monkeypatch.setenv(metrics.ENV, "unset-after-test")  # restores the environment afterwards
    # Earlier in-process tests (a Router counting routing decisions) may have created this
    # process's metric objects; start this one as a fresh launcher would, and put them back after.
    for name in ("_metrics", "_metrics_dir", "_registry"):
        monkeypatch.setattr(metrics, name, None)
    d = tmp_path / "prom"
    d.mkdir()
    (d / "counter_999999.db").write_bytes(b"stale")  # a previous run's file is cleared
    assert metrics.setup_multiprocess_dir(d) == str(d)
    assert os.environ[metrics.ENV] == str(d)
    assert not (d / "counter_999999.db").exists()
    ctx = multiprocessing.get_context("spawn")
    pids = []
    for args in (("decode-0", 1000, 3.0), ("decode-1", 500, 7.0)):
        p = ctx.Process(target=_metrics_child, args=args)
        p.start()
        p.join(60)
        assert p.exitcode == 0
        pids.append(p.pid)
    try:
        body, ctype = metrics.render_latest()
        assert ctype.startswith("text/plain")
        s = _samples(body.decode())
        pre = (("instance", "prefill-0"), ("pool", "prefill"))
        assert s[("epd_kv_transfer_bytes_total", pre)] == 1500
        assert s[("epd_prefix_cache_queries_tokens_total", pre)] == 200
        assert s[("epd_prefix_cache_hits_tokens_total", pre + (("tier", "device"),))] == 50
        assert s[("epd_encoder_cache_hits_total", (("instance", "encode-0"), ("pool", "encode")))] == 2
        assert s[("epd_kv_transfer_seconds_count", pre)] == 2
        assert s[("epd_kv_transfer_seconds_bucket", pre[:1] + (("le", "0.005"),) + pre[1:])] == 2
        assert s[("epd_kv_transfer_seconds_bucket", pre[:1] + (("le", "0.001"),) + pre[1:])] == 0
        for inst in ("decode-0", "decode-1"):
            lab = (("instance", inst), ("pool", "decode"))
            assert s[("epd_time_to_first_token_seconds_count", lab)] == 1
            assert s[("epd_time_to_first_token_seconds_sum", lab)] == pytest.approx(0.4)
        d0 = (("instance", "decode-0"), ("pool", "decode"))
        assert s[("epd_queue_depth", d0)] == 7.0  # livemax over both processes
        assert s[("epd_running_requests", (("instance", "decode-1"), ("pool", "decode")))] == 8.0
        # the second process dies: its live gauges go, its counters stay
        metrics.mark_process_dead(pids[1])
        s = _samples(metrics.render_latest()[0].decode())
        assert s[("epd_queue_depth", d0)] == 3.0
        assert ("epd_running_requests", (("instance", "decode-1"), ("pool", "decode"))) not in s
        assert s[("epd_kv_transfer_bytes_total", pre)] == 1500
    finally:
        metrics._reset_for_tests()


def test_metric_names_match_design():
    from epd import metrics

    names = {n for n, *_ in metrics._HISTOGRAMS.values()} | {n + "_total" for n, _ in metrics._COUNTERS.values()} \
        | {n for n, *_ in metrics._GAUGES.values()} | {n + "_total" for n, *_ in metrics._LABELLED_COUNTERS.values()}
    design = Path(__file__).resolve().parents[2] / "shared" / "DESIGN.md"
    expected = {
        "epd_time_to_first_token_seconds", "epd_time_per_output_token_seconds", "epd_inter_token_latency_seconds",
        "epd_e2e_request_latency_seconds", "epd_encode_queue_seconds", "epd_encode_seconds",
        "epd_embedding_transfer_seconds", "epd_prefill_queue_seconds", "epd_prefill_seconds",
        "epd_kv_transfer_seconds", "epd_decode_queue_seconds", "epd_decode_step_seconds",
        "epd_kv_transfer_bytes_total", "epd_kv_transfer_failures_total", "epd_kv_transfer_retries_total",
        "epd_preemptions_total", "epd_cancelled_requests_total", "epd_migrated_requests_total",
        "epd_prefix_cache_queries_tokens_total", "epd_prefix_cache_hits_tokens_total",
        "epd_encoder_cache_queries_total", "epd_encoder_cache_hits_total",
        "epd_kv_cache_usage_ratio", "epd_queue_depth", "epd_running_requests",
    }
    # Every DESIGN.md metric exists; metrics beyond it are documented on Metrics.
    assert expected <= names, expected - names
    fields = {**metrics._HISTOGRAMS, **metrics._COUNTERS, **metrics._GAUGES, **metrics._LABELLED_COUNTERS}
    for field, (name, *_) in fields.items():
        if (name if name in names else name + "_total") not in expected:
            assert f"        {field}:" in metrics.Metrics.__doc__, f"{name} is neither in DESIGN.md nor documented"
    if design.is_file():
        text = design.read_text()
        for n in expected:
            if "cache_" not in n:  # the cache counters are written with {queries,hits} braces there
                assert f"`{n}`" in text, n


def test_metrics_single_process_mode(monkeypatch):
    from epd import metrics

    monkeypatch.delenv(metrics.ENV, raising=False)
    metrics._reset_for_tests()
    try:
        m = metrics.get_metrics()
        assert metrics.get_metrics() is m
        m.preemptions.labels(pool="decode", instance="decode-0").inc(2)
        m.kv_cache_usage_ratio.labels(pool="decode", instance="decode-0").set(0.25)
        s = _samples(metrics.render_latest()[0].decode())
        lab = (("instance", "decode-0"), ("pool", "decode"))
        assert s[("epd_preemptions_total", lab)] == 2
        assert s[("epd_kv_cache_usage_ratio", lab)] == 0.25
        metrics.mark_process_dead(12345)  # no-op without a directory
        with pytest.raises(RuntimeError, match="before get_metrics"):
            metrics.setup_multiprocess_dir()
    finally:
        metrics._reset_for_tests()
