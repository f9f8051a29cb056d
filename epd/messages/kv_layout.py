"""What a worker advertises about its KV memory (inside ``WorkerReady`` / ``PeerInfo``):
``KVLayout`` and, with per-rank agents, every rank's ``RankKV``."""

from __future__ import annotations

import msgspec
import torch

from epd.messages.base import Region

#: a KVLayout's ``dtype``: a float dtype, or a quantized cache's kind (uint8 rows, epd.kernels.kv_quant)
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "int8": torch.uint8, "fp8_e4m3": torch.uint8}


class RankKV(msgspec.Struct, frozen=True):
    """One TP rank's own NIXL agent and the memory it exposes (``--kv-agents per-rank``).

    ``agent``: the agent's name (rank 0: the instance id; rank r: ``<instance>.tp<r>``);
    ``nixl_metadata``: its ``get_agent_metadata`` bytes (b"" for rank 0, whose metadata is
    the instance's own ``WorkerReady.nixl_metadata``); ``k_regions[l]`` / ``v_regions[l]``:
    layer l of this rank's paged cache; ``staging_regions[l]``: layer l of this rank's
    private staging buffer (its own KV heads only; [] when it has none).
    """

    agent: str
    nixl_metadata: bytes
    k_regions: list[Region]
    v_regions: list[Region]
    staging_regions: list[Region] = []


class KVLayout(msgspec.Struct, frozen=True):
    """How a worker's paged KV cache lies in memory (per TP rank).

    k and v caches: [num_layers, num_blocks, block_size, num_kv_heads, head_dim];
    ``k_regions[l]`` / ``v_regions[l]`` cover layer l's [num_blocks, ...] slab.
    ``tp``: the instance's TP ranks (``num_kv_heads`` is per rank). A worker with a
    staging pool (heterogeneous TP, ``epd.transfer.staging``) advertises it:
    ``staging_regions[l]`` covers layer l of the pool, ``staging_block_bytes`` is one
    staging block (K and V of every KV head) of one layer. With ``kv_agents`` "per-rank"
    ``ranks[r]`` is rank r's agent and regions (rank 0's equal the fields above).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    k_regions: list[Region]
    v_regions: list[Region]
    tp: int = 1
    staging_regions: list[Region] = []
    staging_block_bytes: int = 0
    #: "rank0": one agent (rank 0's) and a staging pool shared by every rank; "per-rank":
    #: every rank owns an agent (``ranks``), its own KV regions and its own staging buffer,
    #: whose block then holds this rank's heads only (``staging_block_bytes`` / tp).
    kv_agents: str = "rank0"
    ranks: list[RankKV] = []

    def same_blocks(self, other: KVLayout | None) -> bool:
        """Whether a block moves between this layout and ``other`` byte for byte, block to
        block: both TP 1, and the same layers, block size, KV heads, row length and dtype."""
        return (other is not None and self.tp == 1 and other.tp == 1
                and (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
                == (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype))

    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=_KV_DTYPES[self.dtype]).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem
