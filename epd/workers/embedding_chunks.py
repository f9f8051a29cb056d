"""The prefill side's check and join of embeddings read from one or several encoders.

A long video may arrive as chunks of temporal patches encoded on different instances
(``epd.router.encode_split``): ``join_chunks`` checks them against the prompt's
placeholders (another process sent them) and concatenates each item's chunks in
temporal order, giving one embedding per placeholder.
"""

from __future__ import annotations

import torch

from epd.errors import InternalError
from epd.messages import EmbeddingRef
from epd.multimodal import Placeholder


class EmbeddingChunkError(InternalError):
    """Embeddings from the encode pool that do not fit the prompt's placeholders (a buggy
    or hostile peer): the request fails (500), the message says which item and why."""


def join_chunks(refs: list[EmbeddingRef], tensors: list[torch.Tensor], placeholders: list[Placeholder] | None
                ) -> list[torch.Tensor]:
    """One ``[placeholder.length, hidden]`` tensor per item from ``tensors[k]`` (``[rows,
    hidden]``, the rows read for ``refs[k]``).

    Consecutive refs of one item's chunks (``temporal_range`` (0, b1), (b1, b2), ...) are
    concatenated; a ref without a range is an item of its own. With ``placeholders``
    (None: not checked, the refs are taken as they are), the items must be as many as
    the placeholders and each must give its placeholder's ``length`` rows; a split item
    must carry its placeholder's item hash, its chunks the same hidden size and dtype,
    and its last chunk must end at the placeholder's temporal patches (``grid_thw[0]``).

    Raises:
        EmbeddingChunkError: a chunk out of order or of another item, rows that do not sum
            to the placeholder's length, mismatched hidden sizes / dtypes, or another number
            of items than of placeholders.
    """
    groups: list[list[int]] = []
    for k, ref in enumerate(refs):
        rng = ref.temporal_range
        if rng is None or rng[0] == 0:
            groups.append([k])
            continue
        prev = refs[groups[-1][-1]] if groups else None
        if prev is None or prev.temporal_range is None or prev.temporal_range[1] != rng[0] \
                or prev.item_hash != ref.item_hash:
            raise EmbeddingChunkError(f"embedding chunk {tuple(rng)} of item {ref.item_hash[:12]} (from "
                                      f"{ref.instance_id or 'the encoder'}) does not follow the item's previous chunk")
        groups[-1].append(k)
    if placeholders is not None and len(groups) != len(placeholders):
        raise EmbeddingChunkError(f"{len(groups)} embeddings from the encode pool for {len(placeholders)} "
                                  f"placeholders")
    out = []
    for g, members in enumerate(groups):
        parts = [tensors[k] for k in members]
        if len(members) > 1 or refs[members[0]].temporal_range is not None:
            _check_chunks([refs[k] for k in members], parts, placeholders[g] if placeholders is not None else None)
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        if placeholders is not None and out[-1].shape[0] != placeholders[g].length:
            raise EmbeddingChunkError(f"the embedding of item {refs[members[0]].item_hash[:12]} has "
                                      f"{out[-1].shape[0]} rows, its placeholder {placeholders[g].length}")
    return out


def _check_chunks(refs: list[EmbeddingRef], parts: list[torch.Tensor], ph: Placeholder | None) -> None:
    """The chunks of one split item agree with each other and with its placeholder ``ph``."""
    head = refs[0]
    what = f"video {head.item_hash[:12]} in {len(refs)} chunks ({', '.join(r.instance_id or '?' for r in refs)})"
    shapes = {(tuple(p.shape[1:]), p.dtype) for p in parts}
    if len(shapes) != 1 or any(p.dim() != 2 for p in parts):
        raise EmbeddingChunkError(f"{what}: chunks of different shapes or dtypes "
                                  f"{[(list(p.shape), str(p.dtype)) for p in parts]}")
    if ph is None:
        return
    if head.item_hash != ph.item_hash:
        raise EmbeddingChunkError(f"{what}: the placeholder is of item {ph.item_hash[:12]}")
    rows = sum(p.shape[0] for p in parts)
    if rows != ph.length:
        raise EmbeddingChunkError(f"{what}: chunk rows {[p.shape[0] for p in parts]} sum to {rows}, "
                                  f"the placeholder has {ph.length}")
    if ph.grid_thw is not None and refs[-1].temporal_range[1] != ph.grid_thw[0]:
        raise EmbeddingChunkError(f"{what}: the chunks end at temporal patch {refs[-1].temporal_range[1]}, "
                                  f"the video has {ph.grid_thw[0]}")
