"""Decode worker: reserves blocks, receives prompt KV over NIXL, streams tokens."""

from __future__ import annotations

import logging
import time
from collections import deque

from epd.errors import InvalidRequestError
from epd.messages import (GenerateRequest, KVReady, KVReserved, Message, MessageError, RequestFailed, ReserveKV,
                          TokenOutput, decode)
from epd.workers.engine_worker import EngineWorker

logger = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    """Continuous batching over sequences whose prompt KV another worker wrote.

    ReserveKV -> blocks reserved (or queued until there is room) -> KVReserved;
    the prefill worker's KVReady notification (sent only after every layer's
    write completed) -> the sequence joins the running batch -> TokenOutput
    per generated token. The first token came from prefill and is not repeated.

    An aborted reservation whose KV never arrived is quarantined for
    ``QUARANTINE_S`` before its blocks are free again: a prefill worker that
    was slow (or frozen) may still be mid-write into them, and those bytes must
    not land in another request's blocks.

    A ``GenerateRequest`` (the router's ``recompute`` answer to a failed KV
    transfer) runs the whole request here, prefill included.
    """

    role = "decode"
    QUARANTINE_S = 1.0

    def __init__(self, args) -> None:
        super().__init__(args)
        self.pending: deque[ReserveKV] = deque()
        self.quarantine: deque[tuple[float, str]] = deque()  # (free at, request id), in time order
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message) -> None:
        if isinstance(msg, ReserveKV):
            self.pending.append(msg)
            self._reserve_pending()
        elif isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), msg.params.to_params())
            except (InvalidRequestError, ValueError) as e:
                self.send(RequestFailed(msg.request_id, self.instance_id, str(e)))
        else:
            super().handle_role(msg)

    def _reserve_pending(self) -> None:
        while self.pending:
            msg = self.pending[0]
            # Staged KV (heterogeneous TP) also needs a contiguous staging range.
            n_staging = -(-len(msg.prompt_token_ids) // self.engine.config.block_size) if self.staging else 0
            try:
                if self.staging is not None and n_staging > self.staging.num_blocks:
                    raise ValueError(f"the prompt's KV needs {n_staging} staging blocks but this decode "
                                     f"instance's staging pool has {self.staging.num_blocks}; raise --kv-staging-mb")
                if self.staging is not None and not self.staging.can_alloc(n_staging):
                    return  # no staging room yet: retry once a staged request arrives or aborts
                blocks = self.engine.reserve(msg.request_id, list(msg.prompt_token_ids), msg.params.to_params())
            except (InvalidRequestError, ValueError) as e:
                self.pending.popleft()
                self.send(RequestFailed(msg.request_id, self.instance_id, str(e)))
                continue
            if blocks is None:
                return  # no room yet: keep order, retry after the next step frees blocks
            self.pending.popleft()
            staging_block = self.staging.alloc(msg.request_id, n_staging) if self.staging is not None else -1
            self.send(KVReserved(msg.request_id, self.instance_id, blocks, staging_block))

    def _unpack_staged(self, msg: KVReady) -> None:
        """Scatter a staged request's KV into its reserved blocks on every TP rank
        (before it joins the batch), then free its staging range."""
        owned = self.staging.owned(msg.request_id) if self.staging is not None else None
        if owned is None:
            return
        start, n = owned
        self.engine.runner.unpack_kv(start, self.engine.reserved[msg.request_id].block_table[:n], msg.src_tp)
        self.staging.free(msg.request_id)

    def _release(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        if self.staging is not None:
            self.staging.free(request_id)

    def poll(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self._release(self.quarantine.popleft()[1])
        if self.pending:
            self._reserve_pending()
        for peer, notifs in self.transport.get_notifs().items():
            for raw in notifs:
                try:
                    msg = decode(raw)
                except MessageError as e:
                    logger.warning("decode %s: bad notification from %s: %s", self.instance_id, peer, e)
                    continue
                if (isinstance(msg, KVReady) and msg.request_id in self.engine.reserved
                        and not any(rid == msg.request_id for _, rid in self.quarantine)):
                    self._unpack_staged(msg)
                    out = self.engine.add_prefilled(msg.request_id, msg.first_token)
                    if out.finished:  # the first token already ended it (EOS, max_tokens=1, ...)
                        self.send(TokenOutput(msg.request_id, [], True, out.outputs[0].finish_reason))

    def step(self) -> None:
        self.stream_step()

    def abort(self, request_id: str) -> None:
        self.pending = deque(m for m in self.pending if m.request_id != request_id)
        if request_id in self.engine.reserved:  # KV may still be in flight into these blocks
            if all(rid != request_id for _, rid in self.quarantine):
                self.quarantine.append((time.monotonic() + self.QUARANTINE_S, request_id))
            return
        self._release(request_id)

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["num_quarantined"] = len(self.quarantine)
        return s
