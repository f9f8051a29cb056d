"""Request ids on the wire are the server's own and unique (review defect 3).

A realtime transcription's router request id used to be built from the client's item
id, and the router's mailbox replaced a live id's queue without a check: two sessions
that named an item alike had their transcripts cross. Now (1) the router refuses a
request id that is live (``RequestError``, 500: the caller's bug, never the client's),
and the live request is undisturbed; (2) the realtime session never derives a wire id
from a client id. A real ``Router`` with no worker processes, as in
tests/router/test_request_states.py; sessions without a server, as in
tests/api/test_realtime_session.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest

from epd.api.completions import ApiState
from epd.api.realtime.session import RealtimeSession
from epd.messages import EncodeDone, TokenOutput
from epd.multimodal import MediaItem
from epd.router.router import RequestError, Router, RouterRequest
from epd.sampling_params import SamplingParams
from tests.router.test_request_states import Probe, ready, settle


def with_router(body):
    async def main():
        router = Router(decode_routing="round-robin", prefill_routing="round-robin")
        try:
            probe = Probe(router)  # first: rendering the metrics may take a while on a busy machine
            for inst, role in (("encode-0", "encode"), ("pd-0", "pd")):
                router._dispatch(ready(inst, role))
            await body(router, probe)
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())


def test_router_refuses_a_live_transcription_id_and_keeps_the_live_one():
    async def body(router: Router, probe: Probe) -> None:
        item = MediaItem("audio", "a" * 64, {}, 0)
        live = asyncio.ensure_future(router.transcribe("t1", [item]))
        await settle()
        probe.check("encode", "t1")
        with pytest.raises(RequestError) as e:
            await router.transcribe("t1", [MediaItem("audio", "b" * 64, {}, 0)])
        assert e.value.status == 500 and "t1" in str(e.value)
        probe.check("encode", "t1")  # the refused one touched neither the live state nor its queue
        router._dispatch(EncodeDone("t1", "encode-0", [], ["hello"]))
        assert await live == ["hello"]
        probe.check(None, "t1")
        assert router.state_counts["cancelled"] == 0 and router.state_counts["done"] == 1

    with_router(body)


def test_router_refuses_a_live_generate_id_and_keeps_the_live_stream():
    async def body(router: Router, probe: Probe) -> None:
        gen = router.generate(RouterRequest("g1", [1, 2, 3], SamplingParams(max_tokens=2)))
        first = asyncio.ensure_future(gen.__anext__())
        await settle()
        twin = router.generate(RouterRequest("g1", [4, 5, 6], SamplingParams(max_tokens=2)))
        with pytest.raises(RequestError) as e:
            await twin.__anext__()
        assert e.value.status == 500
        probe.check("prefill", "g1")  # GenerateRequest out on the pd worker, its state untouched
        router._dispatch(TokenOutput("g1", [7]))
        assert (await first).token_ids == [7]  # still delivered to the live stream's queue
        router._dispatch(TokenOutput("g1", [8], True, "length"))
        assert (await gen.__anext__()).finished
        await gen.aclose()

    with_router(body)


class RecordingRouter:
    """Answers each transcription with the text it was told for that clip's first sample."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def has_pool(self, role):  # no tts pool: sessions answer in text
        return False

    async def transcribe(self, rid: str, items: list) -> list[str]:
        self.ids.append(rid)
        await asyncio.sleep(0)
        return [f"clip {int(items[0].data['audio'][0] * 32768)}"]


def _session(router) -> RealtimeSession:
    processor = SimpleNamespace(modalities={"audio": "transcribe"},
                                audio_item=lambda a: MediaItem("audio", "h" * 64, {"audio": a[0] / 32768.0}, 0))
    api = SimpleNamespace(model_name="m", max_model_len=64, default_max_tokens=16, router=router,
                          processor=processor, state=ApiState(), max_pending_requests=8, idle_timeout_s=None)
    return RealtimeSession(ws=None, api=api)


def _clip(first_sample: int) -> str:
    pcm = np.zeros(4800, dtype="<i2")  # 200 ms at 24 kHz
    pcm[0] = first_sample
    return base64.b64encode(pcm.tobytes()).decode()


def test_two_sessions_with_the_same_client_item_id_get_distinct_wire_ids():
    async def main():
        router = RecordingRouter()
        a, b = _session(router), _session(router)
        for s, sample in ((a, 100), (b, 200)):
            await s.handle(json.dumps({"type": "conversation.item.create", "item": {
                "id": "item_same", "type": "message", "role": "user",
                "content": [{"type": "input_audio", "audio": _clip(sample)}]}}))
        texts = [await s.items[0].parts[0].asr for s in (a, b)]
        return router.ids, texts, [s.items[0].id for s in (a, b)]

    ids, texts, item_ids = asyncio.run(main())
    assert item_ids == ["item_same", "item_same"]  # the client's ids are kept as the client's
    assert texts == ["clip 100", "clip 200"]
    assert len(ids) == 2 and len(set(ids)) == 2, ids
    assert not any("item_same" in rid for rid in ids), ids  # never derived from a client id
