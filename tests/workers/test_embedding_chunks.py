"""The prefill side's join of embeddings read from several encoders
(``epd.workers.embedding_chunks.join_chunks``): a video's chunks are concatenated in
temporal order into its placeholder; chunks that do not fit (rows, order, item, hidden
size, dtype, count) are refused with a message saying which item and why."""

from __future__ import annotations

import pytest
import torch

from epd.messages import EmbeddingRef
from epd.multimodal import Placeholder
from epd.workers.embedding_chunks import EmbeddingChunkError, join_chunks

HIDDEN = 8
VIDEO, IMAGE = "ab" * 32, "cd" * 32


def _ref(item: str, rows: int, rng=None, inst: str = "encode-0", dtype: str = "float32") -> EmbeddingRef:
    return EmbeddingRef(item, (0, rows * HIDDEN * 4, 0), [rows, HIDDEN], dtype, inst, rng)


def _rows(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) + start


PLACEHOLDERS = [Placeholder(3, 4, IMAGE, (1, 4, 4)), Placeholder(10, 12, VIDEO, (4, 4, 6))]


def test_chunks_of_a_video_are_concatenated_in_temporal_order():
    refs = [_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2), "encode-1"), _ref(VIDEO, 6, (2, 4), "encode-0")]
    parts = [_rows(4), _rows(6), _rows(6, 100.0)]
    image, video = join_chunks(refs, parts, PLACEHOLDERS)
    torch.testing.assert_close(image, parts[0])
    torch.testing.assert_close(video, torch.cat(parts[1:]))


def test_whole_items_pass_through():
    out = join_chunks([_ref(IMAGE, 4), _ref(VIDEO, 12)], [_rows(4), _rows(12)], PLACEHOLDERS)
    assert [o.shape[0] for o in out] == [4, 12]


@pytest.mark.parametrize("refs,parts,match", [
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 5, (2, 4), "encode-1")], [_rows(4), _rows(6), _rows(5)],
     "sum to 11, the placeholder has 12"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 6, (3, 4))], [_rows(4), _rows(6), _rows(6)],
     "does not follow"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (2, 4)), _ref(VIDEO, 6, (0, 2))], [_rows(4), _rows(6), _rows(6)],
     "does not follow"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(IMAGE, 6, (2, 4))], [_rows(4), _rows(6), _rows(6)],
     "does not follow"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 6, (2, 4))], [_rows(4), _rows(6), torch.zeros(6, 4)],
     "different shapes or dtypes"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 6, (2, 4))],
     [_rows(4), _rows(6), _rows(6).to(torch.float16)], "different shapes or dtypes"),
    ([_ref(IMAGE, 4), _ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 6, (2, 3))], [_rows(4), _rows(6), _rows(6)],
     "end at temporal patch 3, the video has 4"),
    ([_ref(IMAGE, 4), _ref(IMAGE, 6, (0, 2)), _ref(IMAGE, 6, (2, 4))], [_rows(4), _rows(6), _rows(6)],
     "the placeholder is of item"),
    ([_ref(VIDEO, 6, (0, 2)), _ref(VIDEO, 6, (2, 4))], [_rows(6), _rows(6)], "1 embeddings from the encode pool for 2"),
    ([_ref(IMAGE, 5), _ref(VIDEO, 12)], [_rows(5), _rows(12)], "has 5 rows, its placeholder 4"),
], ids=["rows", "gap", "out of order", "another item", "hidden", "dtype", "short", "wrong item", "count",
        "whole item rows"])
def test_chunks_that_do_not_fit_are_refused(refs, parts, match):
    with pytest.raises(EmbeddingChunkError, match=match):
        join_chunks(refs, parts, PLACEHOLDERS)


def test_a_refusal_is_a_500():
    from epd.errors import error_status

    assert error_status(EmbeddingChunkError("x")) == 500
