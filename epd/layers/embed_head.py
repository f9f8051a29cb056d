"""Vocab-parallel embedding and LM head (vocabulary split over TP ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.distributed import all_reduce, gather_last_dim, tp_rank, tp_size
from epd.kernels.linear import PackedWeight, linear, prepare_weight


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows [rank * V/tp, (rank+1) * V/tp) on each rank.

    input_ids: [num_tokens] int64 -> [num_tokens, hidden]. Ids outside this
    rank's range embed to zero before the all-reduce. The vocabulary is padded
    up to a multiple of tp; padded rows are zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.per_rank * self.tp_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.vocab_start:self.vocab_start + self.per_rank]
        param.data.zero_()
        param.data[:rows.size(0)].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head sharing the embedding's vocab split; logits gathered on rank 0.

    hidden: [n, hidden] -> logits [n, vocab] (fp32) on rank 0, None on others.
    After ``process_weights_after_loading`` the head multiplies its own copy of the
    weight: int8 with a [V/tp] fp32 scale (``quantization="int8"``), packed for the CPU
    kernel on the CPU; ``weight`` stays, as a tied embedding still looks tokens up in it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.head_weight: torch.Tensor | PackedWeight | None = None
        self.weight_scale: torch.Tensor | None = None

    def process_weights_after_loading(self, quantization: str | None) -> None:
        """Quantize (``"int8"``) and, on the CPU, pack the head's copy of the weight."""
        w, self.weight_scale = prepare_weight(self.weight.data, quantization)
        self.head_weight = w if isinstance(w, PackedWeight) or self.weight_scale is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        weight = self.head_weight if self.head_weight is not None else self.weight
        logits = linear(hidden, weight, None, self.weight_scale)  # (a PackedWeight carries its own scale)
        logits = gather_last_dim(logits)
        if logits is None:
            return None
        return logits[..., :self.num_embeddings].float()
