"""Wire checks: the in-process types go on the wire as they are, and decode refuses bad values."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from epd.messages import (
    EncodeRequest,
    GenerateRequest,
    MessageError,
    PrefillRequest,
    ReserveKV,
    TensorBlob,
    decode,
    encode,
)
from epd.messages import tensors as messages
from epd.multimodal import MediaItem, Placeholder
from epd.sampling_params import SamplingParams


def _raw(msg: dict) -> bytes:
    """A control message built by hand (what a buggy or hostile peer could send)."""
    return msgspec.msgpack.encode(msg)


def _reserve(params: dict) -> bytes:
    return _raw({"type": "reserve", "request_id": "r", "prompt_token_ids": [1, 2], "params": params})


def test_sampling_params_round_trip_as_is():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=5, max_tokens=3, stop="END",
                        stop_token_ids=[7], logprobs=2)
    out = decode(encode(ReserveKV("r", [1, 2], sp)))
    assert type(out.params) is SamplingParams and out.params == sp
    assert out.params.top_k == 0 and out.params.stop == ["END"]
    assert decode(encode(ReserveKV("r", [1], SamplingParams()))).params == SamplingParams()


def test_valid_hand_built_params_decode():
    assert decode(_reserve({"temperature": 0, "max_tokens": 4})).params.greedy


@pytest.mark.parametrize("params", [
    {"top_p": 1.5}, {"top_p": 0.0}, {"temperature": -1.0}, {"temperature": math.nan}, {"max_tokens": 0},
    {"top_k": -2}, {"presence_penalty": 3.0}, {"seed": -1}, {"seed": 2**63}, {"logprobs": 21},
    {"stop_token_ids": [-1]}, {"stop": [""]}, {"max_tokens": "4"}, {"max_tokens": True},
])
def test_out_of_range_sampling_params_fail_to_decode(params):
    with pytest.raises(MessageError):
        decode(_reserve(params))


def test_sampling_params_replace_validates_again():
    sp = SamplingParams(max_tokens=4)
    assert msgspec.structs.replace(sp, max_tokens=2).max_tokens == 2
    with pytest.raises(ValueError, match="max_tokens"):
        msgspec.structs.replace(sp, max_tokens=0)


def test_placeholders_round_trip():
    ph = [Placeholder(3, 4, "ab" * 32), Placeholder(9, 1, "cd" * 32)]
    out = decode(encode(GenerateRequest("r", [1] * 12, SamplingParams(), ph)))
    assert out.placeholders == ph and all(type(p) is Placeholder for p in out.placeholders)
    assert hash(ph[0]) == hash(Placeholder(3, 4, "ab" * 32))
    out = decode(encode(PrefillRequest("r", [1] * 12, SamplingParams(), "d0", [0, 1], ph)))
    assert out.placeholders == ph


def test_media_item_round_trips_with_exact_tensors():
    g = torch.Generator().manual_seed(0)
    data = {
        "pixel_values": torch.randn(3, 8, 6, generator=g)[:, ::2],  # non-contiguous view
        "num_frames": torch.tensor([3000, 17]),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "bytes": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "no_bytes": torch.zeros(0, dtype=torch.uint8),
    }
    item = MediaItem("image", "ff" * 32, data, 12)
    out = decode(encode(EncodeRequest("r", [item, MediaItem("audio", "ee" * 32)]))).items
    assert [type(it) for it in out] == [MediaItem, MediaItem]
    assert (out[0].modality, out[0].item_hash, out[0].num_tokens) == ("image", "ff" * 32, 12)
    assert set(out[0].data) == set(data)
    for k, t in data.items():
        got = out[0].data[k]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
    assert out[1].data == {} and out[1].num_tokens == 0


def _encode_request(blob: dict) -> bytes:
    return _raw({"type": "encode", "request_id": "r",
                 "items": [{"modality": "image", "item_hash": "h", "data": {"pixel_values": blob},
                            "num_tokens": 1}]})


def test_hand_built_tensor_decodes():
    raw = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    t = decode(_encode_request({"dtype": "float32", "shape": [2, 3], "data": raw})).items[0].data["pixel_values"]
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3))


@pytest.mark.parametrize("blob", [
    {"dtype": "float32", "shape": [2, 3], "data": b"\0" * 20},  # shape implies 24 bytes
    {"dtype": "float32", "shape": [2, 3], "data": b"\0" * 28},
    {"dtype": "float32", "shape": [-2, -3], "data": b"\0" * 24},
    {"dtype": "float64", "shape": [3], "data": b"\0" * 24},  # off the allow-list
    {"dtype": "object", "shape": [1], "data": b"\0" * 8},
    {"dtype": "float32", "shape": [2], "data": "not bytes"},
    {"dtype": "uint8", "shape": [1], "data": "AA=="},  # base64 text is not raw bytes
    {"dtype": "uint8", "shape": [1.0], "data": b"\0"},
    {"dtype": "float32", "data": b"\0" * 4},
    "a string, not a tensor",
])
def test_tampered_tensors_are_refused(blob):
    with pytest.raises(MessageError):
        decode(_encode_request(blob))


def test_empty_tensor_never_crashes_the_decoder():
    try:
        t = decode(_encode_request({"dtype": "float32", "shape": [0, 4], "data": b""})).items[0].data["pixel_values"]
    except MessageError:
        return
    assert t.shape == (0, 4) and t.dtype == torch.float32


def test_tensor_over_the_size_limit_is_refused(monkeypatch):
    monkeypatch.setattr(messages, "MAX_TENSOR_BYTES", 64)
    ok = MediaItem("image", "h", {"pixel_values": torch.zeros(16)}, 1)  # 64 bytes: at the limit
    assert decode(encode(EncodeRequest("r", [ok]))).items[0].data["pixel_values"].shape == (16,)
    big = MediaItem("image", "h", {"pixel_values": torch.zeros(17)}, 1)
    with pytest.raises(MessageError):
        decode(encode(EncodeRequest("r", [big])))


def test_unsendable_values_are_refused_on_encode():
    with pytest.raises(MessageError):
        encode(EncodeRequest("r", [MediaItem("image", "h", {"x": torch.zeros(2, dtype=torch.float64)})]))
    with pytest.raises(TypeError):  # never pickled
        encode(EncodeRequest("r", [MediaItem("image", "h", {"x": object()})]))  # type: ignore[dict-item]


def test_tensor_blob_is_the_wire_form_of_a_tensor():
    t = torch.arange(4, dtype=torch.int32)
    item = MediaItem("image", "h", {"x": t})
    blob = msgspec.msgpack.decode(encode(EncodeRequest("r", [item])))["items"][0]["data"]["x"]
    assert blob == msgspec.msgpack.decode(msgspec.msgpack.encode(TensorBlob.from_tensor(t)))


def test_typed_view_checks_what_a_peer_claims_about_raw_bytes():
    """Embeddings read over NIXL are raw bytes in a buffer; the header came from another process."""
    from epd.messages import typed_view

    raw = torch.arange(6, dtype=torch.float32).view(torch.uint8)
    t = typed_view(raw, "float32", [2, 3])
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert t.data_ptr() == raw.data_ptr()  # a view: the caller decides where to copy it
    for dtype, shape in (("float32", [2, 2]), ("float32", [7]), ("float64", [3]), ("object", [6]),
                         (None, [6]), ("float32", [-2, -3]), ("float32", [2.0, 3])):
        with pytest.raises(MessageError):
            typed_view(raw, dtype, shape)


def test_video_chunk_ranges_and_ref_instances_round_trip():
    """A chunk's temporal range (EncodeRequest, EmbeddingRef) and the instance holding a ref
    survive the wire; a range that is not two integers is refused on decode."""
    from epd.messages import EmbeddingRef, EncodeDone

    item = MediaItem("video", "ab" * 32, {"video_grid_thw": torch.tensor([4, 2, 2])}, 4)
    req = decode(encode(EncodeRequest("r", [item, item], [(0, 2), None])))
    assert req.temporal_ranges == [(0, 2), None]
    ref = EmbeddingRef("ab" * 32, (64, 128, 0), [2, 16], "float32", "encode-1", (2, 4))
    assert decode(encode(EncodeDone("r", "encode-1", [ref]))).embeddings == [ref]
    assert decode(encode(EncodeRequest("r", [item]))).temporal_ranges == []  # older senders: every item whole
    raw = msgspec.msgpack.encode({"type": "encode", "request_id": "r", "items": [], "temporal_ranges": [[0, 1, 2]]})
    with pytest.raises(MessageError):
        decode(raw)
    raw = msgspec.msgpack.encode({"type": "encode", "request_id": "r", "items": [], "temporal_ranges": [["0", 1]]})
    with pytest.raises(MessageError):
        decode(raw)
