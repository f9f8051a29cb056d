"""A command a worker cannot read still fails the request it names: the router hears a
``RequestFailed`` at once instead of waiting out its stage timeout."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from epd.messages import (
    MAX_TENSOR_BYTES,
    EncodeRequest,
    MessageError,
    RequestFailed,
    decode,
    encode,
    request_id_of,
)
from epd.multimodal import MediaItem
from epd.workers.base import BaseWorker


def _oversized_encode_request(rid: str) -> bytes:
    """An ``EncodeRequest`` whose pixel tensor declares more than ``MAX_TENSOR_BYTES``, as an
    item too large for the wire arrives (the bytes themselves are kept small here)."""
    item = MediaItem("image", "h" * 64, {"pixel_values": torch.zeros(4, 8)}, 4)
    raw = msgspec.msgpack.decode(encode(EncodeRequest(rid, [item])))
    raw["items"][0]["data"]["pixel_values"]["shape"] = [MAX_TENSOR_BYTES // 4 + 1]
    return msgspec.msgpack.encode(raw)


def test_the_request_id_of_a_refused_command_is_read():
    data = _oversized_encode_request("chatcmpl-7-0")
    with pytest.raises(MessageError, match="limit"):
        decode(data)
    assert request_id_of(data) == "chatcmpl-7-0"
    assert request_id_of(msgspec.msgpack.encode({"type": "encode", "items": 3})) is None  # names none
    assert request_id_of(b"\xc1 not msgpack") is None
    assert request_id_of(msgspec.msgpack.encode({"request_id": "x" * 10_000})) is None  # not echoed back


class _Commands:
    """A command socket holding ``frames`` (``recv`` as zmq's, non-blocking)."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = list(frames)

    def recv(self, flags: int = 0) -> bytes:
        if not self.frames:
            raise zmq.Again()
        return self.frames.pop(0)


def test_a_worker_answers_request_failed_for_a_command_it_cannot_read():
    sent: list = []
    worker = SimpleNamespace(instance_id="encode-0", send=sent.append, handle=lambda msg: None,
                             cmd=_Commands([_oversized_encode_request("chatcmpl-7-0"), b"\xc1 junk",
                                            msgspec.msgpack.encode({"type": "abort"})]))
    worker.fail = lambda rid, exc, **kw: BaseWorker.fail(worker, rid, exc, **kw)
    BaseWorker._drain(worker)
    assert len(sent) == 1, sent  # the junk and the nameless command name no request
    failed = sent[0]
    assert isinstance(failed, RequestFailed) and failed.request_id == "chatcmpl-7-0"
    assert failed.instance_id == "encode-0" and failed.status == 500 and not failed.retryable
    assert "could not read its command" in failed.error and str(MAX_TENSOR_BYTES) in failed.error
    assert isinstance(decode(encode(failed)), RequestFailed)  # it goes out as a well-formed message
