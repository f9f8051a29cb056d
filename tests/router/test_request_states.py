"""The router's request states (epd.router.request) and their gauge ``epd_router_requests``.

A real ``Router`` with no worker processes: the tests register workers and play
their replies through the router's message dispatch, and check after each
reply which state the request is in, in the state map and in the gauge.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from epd import metrics
from epd.messages import EncodeDone, KVLayout, KVReserved, PrefillDone, RequestFailed, TokenOutput, WorkerReady
from epd.multimodal import MediaItem
from epd.router.request import LIVE_STATES
from epd.router.router import RequestError, Router, RouterRequest
from epd.sampling_params import SamplingParams

LIVE = [s.value for s in LIVE_STATES]


def ready(inst: str, role: str) -> WorkerReady:
    layout = KVLayout(2, 64, 4, 2, 16, "float32", [], []) if role != "encode" else None
    return WorkerReady(role, inst, 1000, "tcp://127.0.0.1:1", b"", [], layout)


def gauge() -> dict[str, float]:
    text = metrics.render_latest()[0].decode()
    out = dict.fromkeys(LIVE, 0.0)
    for state in LIVE:
        m = re.search(r'^epd_router_requests\{(?=[^}]*state="%s")(?=[^}]*pool="router")[^}]*\} ([0-9.e+-]+)$'
                      % state, text, re.M)
        if m:
            out[state] = float(m.group(1))
    return out


class Probe:
    """The router's state map and gauge, relative to the gauge when it was made."""

    def __init__(self, router: Router) -> None:
        self.router, self.base = router, gauge()

    def check(self, state: str | None, rid: str) -> None:
        states = self.router.states.states
        assert (states.get(rid).value if rid in states else None) == state
        moved = {s: v - self.base[s] for s, v in gauge().items()}
        assert moved == {s: float(s == state) for s in LIVE}, moved


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def with_router(body):
    async def main():
        router = Router(decode_routing="round-robin", prefill_routing="round-robin")
        try:
            for inst, role in (("encode-0", "encode"), ("prefill-0", "prefill"), ("decode-0", "decode")):
                router._dispatch(ready(inst, role))
            await body(router, Probe(router))
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())


def test_disaggregated_request_walks_prefill_transfer_decode_and_leaves_the_map():
    async def body(router: Router, probe: Probe) -> None:
        gen = router.generate(RouterRequest("r1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)))
        first = asyncio.ensure_future(gen.__anext__())
        await settle()
        probe.check("prefill", "r1")  # ReserveKV sent
        router._dispatch(KVReserved("r1", "decode-0", [0, 1]))
        await settle()
        probe.check("prefill", "r1")  # PrefillRequest sent
        router._dispatch(PrefillDone("r1", "prefill-0", 7, 0, 64, 0.0, 0.0, 0.0, 1))
        assert (await first).token_ids == [7]
        probe.check("transfer", "r1")  # P's first token is out; D has not streamed yet
        router._dispatch(TokenOutput("r1", [8]))
        assert (await gen.__anext__()).token_ids == [8]
        probe.check("decode", "r1")
        router._dispatch(TokenOutput("r1", [9], True, "length"))
        assert (await gen.__anext__()).finished
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        probe.check(None, "r1")
        assert router.state_counts["done"] == 1

    with_router(body)


def test_cancelled_and_failed_requests_leave_the_map():
    async def body(router: Router, probe: Probe) -> None:
        gen = router.generate(RouterRequest("r2", [1, 2, 3], SamplingParams()))
        task = asyncio.ensure_future(gen.__anext__())
        await settle()
        probe.check("prefill", "r2")
        task.cancel()  # the client's task is gone
        with pytest.raises(asyncio.CancelledError):
            await task
        probe.check(None, "r2")
        assert router.state_counts["cancelled"] == 1

        gen = router.generate(RouterRequest("r3", [1, 2, 3], SamplingParams()))
        task = asyncio.ensure_future(gen.__anext__())
        await settle()
        router._dispatch(RequestFailed("r3", "decode-0", "prompt too long"))  # not retryable
        with pytest.raises(RequestError, match="prompt too long"):
            await task
        probe.check(None, "r3")
        assert router.state_counts["failed"] == 1

    with_router(body)


def test_transcription_is_in_encode_until_done():
    async def body(router: Router, probe: Probe) -> None:
        item = MediaItem("audio", "a" * 64, {}, 0)
        task = asyncio.ensure_future(router.transcribe("t1", [item]))
        await settle()
        probe.check("encode", "t1")
        router._dispatch(EncodeDone("t1", "encode-0", [], ["hello"]))
        assert await task == ["hello"]
        probe.check(None, "t1")

    with_router(body)
