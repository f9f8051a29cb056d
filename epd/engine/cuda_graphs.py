"""Decode steps replayed from CUDA graphs at a set of captured batch sizes.

A decode-only step of n sequences is padded to the smallest captured size >= n and
replayed from the graph captured at that size: the step's inputs are copied into
persistent (static) buffers, which the graph reads in place, and its first n rows of
hidden states are the step's. Padding rows carry token 0 at position 0, slot -1 (the
KV store skips them) and context length 0 (decode attention gives zeros), so they
touch no block. Steps with prefill chunks, media embeddings, a KV-connector hook, more
sequences than the largest size or a wider block table run eagerly. Source: vLLM v1
``gpu_model_runner.py`` (``cudagraph_batch_sizes``, ``_dummy_run``, padding to the
next captured size) and nano-vllm ``ModelRunner.capture_cudagraph``.

On a CPU the same padded path runs eagerly (``capture=False``), which is how its
padding logic is tested without a GPU.
"""

from __future__ import annotations

import torch

from epd.layers.attention import AttentionMetadata, set_attention_metadata


def capture_sizes(max_num_seqs: int, sizes: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """The batch sizes to capture, ascending and at most ``max_num_seqs``: ``sizes`` when
    given, else vLLM's default 1, 2, 4, then multiples of 8 (up to 512).

    Raises:
        ValueError: a size below 1.
    """
    if sizes is None:
        sizes = [1, 2, 4, *range(8, 513, 8)]
    if any(int(s) < 1 for s in sizes):
        raise ValueError(f"CUDA graph sizes must be >= 1, got {list(sizes)}")
    out = sorted({int(s) for s in sizes if int(s) <= max_num_seqs})
    if sizes and not out:
        out = [max_num_seqs]
    return out


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= ``n`` (None: above every size, or no sizes)."""
    for s in sizes:
        if s >= n:
            return s
    return None


class DecodeGraphs:
    """Persistent decode buffers and, on CUDA, one captured graph per batch size.

    Args:
        model: the rank's model (``forward(input_ids, positions, inputs_embeds)``).
        sizes: ascending batch sizes (:func:`capture_sizes`).
        max_blocks: block-table columns of the buffers (``ceil(max_model_len / block_size)``).
        device: where the buffers live.
        capture: capture graphs (CUDA only); False replays the padded step eagerly.

    Buffers: input_ids / positions / slot_mapping [max_size] int64, block_tables
    [max_size, max_blocks] int32, context_lens [max_size] int32.
    """

    def __init__(self, model, sizes: list[int], max_blocks: int, device: torch.device, capture: bool) -> None:
        self.model, self.sizes, self.max_blocks, self.device = model, list(sizes), max_blocks, device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def eligible(self, layout, step) -> bool:
        """Whether a step (its ``StepLayout`` and ``StepInput``) can run padded: decodes
        only, no media rows, staging packs or M-RoPE positions, few enough sequences, narrow enough block
        tables."""
        n = layout.num_decode_tokens
        return (n > 0 and not layout.prefills and not step.mm_rows and not step.kv_packs and not step.mrope_positions
                and layout.num_tokens == n and padded_size(n, self.sizes) is not None
                and layout.decode_width <= self.max_blocks)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size])

    def _forward(self, size: int) -> torch.Tensor:
        with set_attention_metadata(self._metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size], None)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(size)  # warm-up (kernel compilation, allocator)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def load(self, layout) -> int:
        """Copy a step's decode rows (its ``StepLayout``) into the buffers, padding to
        the captured size; returns that size."""
        n = layout.num_decode_tokens
        size = padded_size(n, self.sizes)
        w = layout.decode_width
        self.input_ids[:n].copy_(layout.input_ids)
        self.positions[:n].copy_(layout.positions)
        self.slot_mapping[:n].copy_(layout.slot_mapping)
        self.block_tables[:n, :w].copy_(layout.decode_block_tables)
        self.block_tables[:n, :w].clamp_(min=0)
        self.context_lens[:n].copy_(layout.decode_context_lens)
        # Padding rows: token 0 at position 0, no KV slot, an empty context.
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.context_lens[n:size] = 0
        return size

    @torch.inference_mode()
    def run(self, layout) -> torch.Tensor:
        """Hidden states of a step's decode rows (its ``StepLayout``): [num_decode_tokens, hidden]."""
        size = self.load(layout)
        if size in self.graphs:
            self.graphs[size].replay()
            hidden = self.outputs[size]
        else:
            hidden = self._forward(size)
        return hidden[:layout.num_decode_tokens]
