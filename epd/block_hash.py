"""The identity of a KV block: its hash in a prefix chain.

A full block's hash covers its parent's hash (so the whole prefix before it),
its token ids and the item hashes of the media spans that overlap it, so two
sequences share a block only when everything before and inside it is equal.
The engine's prefix cache (``epd.engine.block_manager``) and the router's KV
index (``epd.router.kv_index``) both hash with these functions, so their hashes
agree (see ``docs/architecture.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np
import xxhash


def placeholder_keys(placeholders, block_index: int, block_size: int) -> tuple[str, ...]:
    """Item hashes of the ``placeholders`` (``epd.multimodal.Placeholder``, or
    anything with ``offset``, ``length``, ``item_hash``) whose span overlaps
    tokens [block_index * block_size, (block_index + 1) * block_size)."""
    if not placeholders:
        return ()
    start, end = block_index * block_size, (block_index + 1) * block_size
    return tuple(p.item_hash for p in placeholders if p.offset < end and p.offset + p.length > start)


def hash_block(parent: bytes | None, token_ids: Seq[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Hash of one full block in a prefix chain: xxh3-128, full 16-byte digest.

    ``parent``: the previous block's hash (None for the first block);
    ``token_ids``: the block's ``block_size`` token ids; ``extra_keys``: media
    item hashes (hex strings) overlapping the block.
    """
    h = xxhash.xxh3_128()
    h.update(parent if parent is not None else b"\0" * 16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for key in extra_keys:
        h.update(b"\x1f")
        h.update(key.encode())
    return h.digest()


def iter_block_hashes(token_ids: Seq[int], block_size: int, placeholders=(),
                      num_blocks: int | None = None) -> Iterator[bytes]:
    """Yield the hash chain of the full blocks of ``token_ids`` (16-byte xxh3-128 each).

    ``placeholders``: media spans (``offset``, ``length``, ``item_hash``); each
    block mixes in the item hashes of the spans it overlaps. ``num_blocks``: stop
    after that many (default: every full block). This is the one definition of a
    block's identity: the engine's prefix cache and the router's KV index
    (``epd.router.kv_index``) both hash with it, so their hashes agree.
    """
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            placeholder_keys(placeholders, i, block_size))
        yield parent
