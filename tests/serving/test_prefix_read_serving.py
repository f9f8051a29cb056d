"""Remote prefix reads between prefill instances (``epd.transfer.remote_prefix``), served:
p:2,d:1 with round-robin prefill routing, so a conversation's second turn lands on the
prefill instance that did not compute its first. The router names the other as the
holder; the reader reads the first turn's blocks from it over NIXL instead of prefilling
them, and answers exactly as the offline engine. A holder killed mid-read and a client
gone mid-read both fall back without losing a block (the reader's transfers are held in
flight with the hold seam, ``EPD_INJECT_HOLD_TRANSFERS``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.serving.conftest import launch
from tests.serving.public_bugs_helpers import Reference, assert_idle, complete, metric, start_and_drop, wait_idle

pytestmark = pytest.mark.slow
BLOCK = 8
FIRST = [20 + (k * 37) % 300 for k in range(81)]  # 10 full blocks + 1 token
ANSWER = 6


@pytest.fixture(scope="module")
def ref(tiny_model_dirs):
    r = Reference(tiny_model_dirs["llama"])
    yield r
    r.close()


def _second_turn(ref: Reference) -> list[int]:
    """The first turn, its answer, and a new question: 13 full blocks, the first 10 the first turn's."""
    answer = list(ref.outputs([FIRST], ANSWER)[0].token_ids)
    return FIRST + answer + [400 + k for k in range(20)]


def _first_turn_reported(server) -> None:
    """The first turn ran on prefill-0 (round-robin); give its KV events (sent once per
    heartbeat, 0.25 s) time to reach the router's index."""
    time.sleep(1.5)


def _launch(path: str, *extra: str, env: dict | None = None):
    return launch(path, "p:2,d:1", "--prefill-routing", "round-robin", "--block-size", str(BLOCK),
                  "--num-kv-blocks", "48", *extra, env=env, timeout_s=900)


def test_second_turn_reads_the_first_turns_blocks_from_the_other_prefill(tiny_model_dirs, ref):
    second = _second_turn(ref)
    want = ref.texts([FIRST, second], ANSWER)
    with _launch(tiny_model_dirs["llama"]) as server:
        before = server.workers()
        assert complete(server, FIRST, ANSWER)["choices"][0]["text"] == want[0]
        _first_turn_reported(server)
        body = complete(server, second, ANSWER)
        assert body["choices"][0]["text"] == want[1]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * BLOCK
        after = assert_idle(server, before)
        reader, holder = after["prefill-1"], after["prefill-0"]
        assert reader["remote_prefix_reads_ok"] == 1 and reader["remote_prefix_read_blocks"] == 10, reader
        assert reader["prefix_cache_remote_hit_tokens"] == 10 * BLOCK
        assert holder["remote_prefix_served_blocks"] == 10 and holder["num_pinned_blocks"] == 0, holder
        assert _settled(server, "epd_kv_remote_prefix_reads_total", 1, instance="prefill-1", outcome="ok") == 1
        assert metric(server, "epd_kv_remote_prefix_read_bytes_total", instance="prefill-1") > 0
        assert _settled(server, "epd_prefix_cache_hits_tokens_total", 10 * BLOCK, instance="prefill-1",
                        tier="remote") == 10 * BLOCK


def test_reads_off_prefill_the_whole_second_turn(tiny_model_dirs, ref):
    second = _second_turn(ref)
    want = ref.texts([FIRST, second], ANSWER)
    with _launch(tiny_model_dirs["llama"], "--no-remote-prefix-reads") as server:
        assert complete(server, FIRST, ANSWER)["choices"][0]["text"] == want[0]
        _first_turn_reported(server)
        body = complete(server, second, ANSWER)
        assert body["choices"][0]["text"] == want[1]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert server.workers()["prefill-1"]["remote_prefix_reads_ok"] == 0


def _settled(server, name: str, want: float, **labels) -> float:
    """The metric once it reached ``want`` (worker metrics move once per heartbeat)."""
    for _ in range(50):
        if (got := metric(server, name, **labels)) >= want:
            return got
        time.sleep(0.1)
    return metric(server, name, **labels)


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared: nothing was held"
        time.sleep(0.05)


def _wait_stat(server, inst: str, key: str, want: float, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (stats := server.workers().get(inst, {})).get(key, 0) < want:
        assert time.monotonic() < deadline, (inst, key, stats)
        time.sleep(0.1)
    return stats


def _launch_held(path: str, tmp_path: Path):
    """p:2,d:1 whose workers' transfers are held while ``tmp_path/hold-<instance>`` exists."""
    return _launch(path, env={"EPD_INJECT_HOLD_TRANSFERS": str(tmp_path / "hold-{agent}")})


def _first_turn_then_hold(server, hold: Path) -> dict:
    """Run the first turn (on prefill-0), then hold ``hold``'s worker's transfers; returns
    the workers' stats before the hold."""
    complete(server, FIRST, ANSWER)
    _first_turn_reported(server)
    before = server.workers()
    hold.touch()
    return before


def test_holder_killed_mid_read_falls_back_to_prefill(tiny_model_dirs, ref, tmp_path):
    """The read stays in flight (held) while the holder is killed: the reader gives it up,
    prefills the whole prompt and answers exactly; the read's blocks come back once it
    terminated."""
    second = _second_turn(ref)
    want = ref.texts([second], ANSWER)[0]
    hold = tmp_path / "hold-prefill-1"
    with _launch_held(tiny_model_dirs["llama"], tmp_path) as server:
        before = _first_turn_then_hold(server, hold)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(complete(server, second, ANSWER)))
        t.start()
        _wait_for(Path(str(hold) + ".held"))  # the read is posted, and stuck
        server.worker_process("prefill-0").kill()
        _wait_stat(server, "prefill-1", "remote_prefix_reads_fallback", 1)
        hold.unlink()  # (its KV write to the decode worker is held too)
        t.join(300)
        assert result["choices"][0]["text"] == want
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stats = wait_idle(server, {"prefill-1": before["prefill-1"], "decode-0": before["decode-0"]})
        assert stats["prefill-1"]["num_free_blocks"] == before["prefill-1"]["num_free_blocks"], stats
        assert stats["prefill-1"]["num_remote_prefix_draining_blocks"] == 0


def test_client_gone_mid_read_unpins_and_frees_every_block(tiny_model_dirs, ref, tmp_path):
    second = _second_turn(ref)
    hold = tmp_path / "hold-prefill-1"
    with _launch_held(tiny_model_dirs["llama"], tmp_path) as server:
        before = _first_turn_then_hold(server, hold)
        dropped = start_and_drop(server, second, after_s=3.0)
        _wait_for(Path(str(hold) + ".held"))
        assert server.workers()["prefill-0"]["num_pinned_blocks"] == 10
        dropped.join()
        stats = _wait_stat(server, "prefill-1", "remote_prefix_reads_aborted", 1)
        assert stats["num_remote_prefix_draining_blocks"] == 10  # the held read may still land in them
        hold.unlink()
        assert_idle(server, before)
        # the next request on the reader runs on those blocks unharmed
        assert complete(server, FIRST, ANSWER)["choices"][0]["text"] == ref.texts([FIRST], ANSWER)[0]
