"""The encode pool's share of a request's items (``epd.router.encode_split``): a Qwen-VL
video of 2+ temporal patches is cut into contiguous, even chunks, at most one per live
encoder, each carrying just its pixel rows; everything else goes to the policy's pick;
``off``, one encoder or one temporal patch never split; the same inputs give the same
shares (so a repeated video meets the same encoder caches)."""

from __future__ import annotations

import pytest
import torch

from epd.multimodal import MediaItem
from epd.router.encode_split import chunk_item, plan_encode, temporal_chunks, temporal_patches

H, W, ROW = 4, 6, 12  # patches per frame grid (h x w) and values per pixel row


def _video(t: int, name: str = "v") -> MediaItem:
    pixels = torch.arange(t * H * W * ROW, dtype=torch.float32).reshape(t * H * W, ROW)
    return MediaItem("video", f"{name}{t}" * 8, {"pixel_values_videos": pixels,
                                                 "video_grid_thw": torch.tensor([t, H, W]),
                                                 "second_per_grid_t": torch.tensor([1.0])}, t * H * W // 4)


def _image() -> MediaItem:
    return MediaItem("image", "img" * 8, {"pixel_values": torch.zeros(H * W, ROW),
                                          "image_grid_thw": torch.tensor([1, H, W])}, H * W // 4)


@pytest.mark.parametrize("t,n,want", [(4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]),
                                      (7, 3, [(0, 3), (3, 5), (5, 7)]), (2, 5, [(0, 1), (1, 2)]),
                                      (3, 1, [(0, 3)])])
def test_temporal_chunks_are_contiguous_and_even(t, n, want):
    assert temporal_chunks(t, n) == want


def test_temporal_chunks_refuse_nothing_to_cut():
    for t, n in ((0, 2), (3, 0)):
        with pytest.raises(ValueError):
            temporal_chunks(t, n)


def test_chunk_item_carries_its_pixel_rows_and_the_whole_grid():
    v = _video(4)
    c = chunk_item(v, (1, 3))
    assert (c.item_hash, c.num_tokens, c.modality) == (v.item_hash, v.num_tokens, "video")
    assert c.data["video_grid_thw"].tolist() == [4, H, W]
    torch.testing.assert_close(c.data["pixel_values_videos"], v.data["pixel_values_videos"][H * W:3 * H * W])
    assert temporal_patches(v) == 4 and temporal_patches(_image()) == 0


def test_a_long_video_is_split_one_chunk_per_encoder_and_the_rest_goes_to_the_pick():
    items = [_image(), _video(4), _video(1, "short")]
    shares = {s.instance_id: s for s in plan_encode(items, "encode-1", ["encode-0", "encode-1"])}
    assert sorted(shares) == ["encode-0", "encode-1"]
    chunks = sorted((rng, inst) for inst, s in shares.items() for rng in s.temporal_ranges if rng is not None)
    assert [rng for rng, _ in chunks] == [(0, 2), (2, 4)]
    assert {inst for _, inst in chunks} == {"encode-0", "encode-1"}  # one chunk each
    pick = shares["encode-1"]
    assert [(it.item_hash, rng) for it, rng in zip(pick.items, pick.temporal_ranges) if rng is None] == \
        [(items[0].item_hash, None), (items[2].item_hash, None)]
    slots = sorted(slot for s in shares.values() for slot in s.slots)
    assert slots == [(0, 0), (1, 0), (1, 1), (2, 0)]
    for s in shares.values():  # each chunk's slot is its temporal order, its rows its own
        for it, rng, slot in zip(s.items, s.temporal_ranges, s.slots):
            if rng is not None:
                assert slot == (1, [(0, 2), (2, 4)].index(rng))
                assert it.data["pixel_values_videos"].shape[0] == (rng[1] - rng[0]) * H * W
    again = {s.instance_id: s.temporal_ranges for s in plan_encode(items, "encode-1", ["encode-1", "encode-0"])}
    assert again == {inst: s.temporal_ranges for inst, s in shares.items()}  # deterministic


def test_no_split_when_off_alone_or_one_patch():
    items = [_video(4)]
    for shares in (plan_encode(items, "encode-0", ["encode-0", "encode-1"], "off"),
                   plan_encode(items, "encode-0", ["encode-0"]),
                   plan_encode([_video(1)], "encode-0", ["encode-0", "encode-1"])):
        assert len(shares) == 1 and shares[0].instance_id == "encode-0" and shares[0].temporal_ranges == [None]


def test_at_most_one_chunk_per_patch_and_encoder():
    shares = plan_encode([_video(2)], "encode-0", ["encode-0", "encode-1", "encode-2"])
    assert sorted(r for s in shares for r in s.temporal_ranges) == [(0, 1), (1, 2)]
    shares = plan_encode([_video(9)], "encode-0", ["encode-0", "encode-1", "encode-2"])
    assert sorted(r for s in shares for r in s.temporal_ranges) == [(0, 3), (3, 6), (6, 9)]
    assert all(len(s.items) == 1 for s in shares)


# ---- the encode stage of a real Router (no worker processes) ------------------------------
def _run_encode(body) -> None:
    import asyncio

    from epd.messages import WorkerReady
    from epd.router.router import Router

    async def main():
        router = Router(encode_routing="round-robin")
        sent: dict[str, list] = {}
        try:
            for inst in ("encode-0", "encode-1"):
                router._dispatch(WorkerReady("encode", inst, 4000 + len(sent), "tcp://127.0.0.1:1", b"", []))
                router.registry.get(inst).send = sent.setdefault(inst, []).append  # what it is told
            await body(router, sent)
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())


def _done(router, inst: str, msg, rows_per_patch: int = H * W // 4):
    from epd.messages import EmbeddingRef, EncodeDone

    refs = []
    for it, rng in zip(msg.items, msg.temporal_ranges or [None] * len(msg.items)):
        rows = it.num_tokens if rng is None else (rng[1] - rng[0]) * rows_per_patch
        refs.append(EmbeddingRef(it.item_hash, (4096 * len(refs), rows * 32, 0), [rows, 8], "float32"))
    router._dispatch(EncodeDone(msg.request_id, inst, refs))


def test_the_encode_stage_sends_each_encoder_its_share_and_orders_the_refs():
    import asyncio

    from epd.messages import Abort, EncodeRequest
    from epd.router.router import RouterRequest
    from epd.sampling_params import SamplingParams

    items = [_image(), _video(4)]

    async def body(router, sent):
        req = RouterRequest("split-1", [1, 2, 3], SamplingParams(), items, [])
        router.pipeline.begin("split-1", "split-1")
        task = asyncio.create_task(router.pipeline.encode(req))
        await asyncio.sleep(0.05)
        msgs = {inst: [m for m in got if isinstance(m, EncodeRequest)] for inst, got in sent.items()}
        assert all(len(m) == 1 for m in msgs.values()), msgs  # one EncodeRequest each
        for inst in reversed(sorted(msgs)):  # EncodeDone in any order
            _done(router, inst, msgs[inst][0])
        pick, refs, _ = await task
        assert [(r.item_hash, r.temporal_range) for r in refs] == \
            [(items[0].item_hash, None), (items[1].item_hash, (0, 2)), (items[1].item_hash, (2, 4))]
        assert {r.instance_id for r in refs[1:]} == {"encode-0", "encode-1"}
        assert refs[0].instance_id == pick
        router.pipeline.end("split-1", abort=True)  # an abandoned attempt: both encoders hear it
        assert all(any(isinstance(m, Abort) and m.request_id == "split-1" for m in got) for got in sent.values())
        assert all(router.registry.get(i).inflight == 0 for i in sent)

    _run_encode(body)


def test_an_encoder_answering_with_the_wrong_number_of_refs_fails_the_stage():
    import asyncio

    from epd.messages import EncodeDone, EncodeRequest
    from epd.router.request import RequestError
    from epd.router.router import RouterRequest
    from epd.sampling_params import SamplingParams

    async def body(router, sent):
        req = RouterRequest("split-2", [1], SamplingParams(), [_video(4)], [])
        router.pipeline.begin("split-2", "split-2")
        task = asyncio.create_task(router.pipeline.encode(req))
        await asyncio.sleep(0.05)
        for inst, got in sent.items():
            msg = next(m for m in got if isinstance(m, EncodeRequest))
            router._dispatch(EncodeDone(msg.request_id, inst, []))  # no refs for its chunk
        with pytest.raises(RequestError, match="sent 0 embeddings for 1 items") as e:
            await task
        assert e.value.status == 500
        router.pipeline.end("split-2", abort=True)

    _run_encode(body)
