"""Decode worker: reserves blocks, receives prompt KV over NIXL, streams tokens."""

from __future__ import annotations

import logging
from collections import deque

from epd.errors import InvalidRequestError
from epd.messages import (KVReady, KVReserved, Message, MessageError, RequestFailed, ReserveKV, TokenOutput,
                          decode)
from epd.workers.engine_worker import EngineWorker

logger = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    """Continuous batching over sequences whose prompt KV another worker wrote.

    ReserveKV -> blocks reserved (or queued until there is room) -> KVReserved;
    the prefill worker's KVReady notification (sent only after every layer's
    write completed) -> the sequence joins the running batch -> TokenOutput
    per generated token. The first token came from prefill and is not repeated.
    """

    role = "decode"

    def __init__(self, args) -> None:
        super().__init__(args)
        self.pending: deque[ReserveKV] = deque()
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message) -> None:
        if isinstance(msg, ReserveKV):
            self.pending.append(msg)
            self._reserve_pending()
        else:
            super().handle_role(msg)

    def _reserve_pending(self) -> None:
        while self.pending:
            msg = self.pending[0]
            try:
                blocks = self.engine.reserve(msg.request_id, list(msg.prompt_token_ids), msg.params.to_params())
            except (InvalidRequestError, ValueError) as e:
                self.pending.popleft()
                self.send(RequestFailed(msg.request_id, self.instance_id, str(e)))
                continue
            if blocks is None:
                return  # no room yet: keep order, retry after the next step frees blocks
            self.pending.popleft()
            self.send(KVReserved(msg.request_id, self.instance_id, blocks))

    def poll(self) -> None:
        if self.pending:
            self._reserve_pending()
        for peer, notifs in self.transport.get_notifs().items():
            for raw in notifs:
                try:
                    msg = decode(raw)
                except MessageError as e:
                    logger.warning("decode %s: bad notification from %s: %s", self.instance_id, peer, e)
                    continue
                if isinstance(msg, KVReady) and msg.request_id in self.engine.reserved:
                    out = self.engine.add_prefilled(msg.request_id, msg.first_token)
                    if out.finished:  # the first token already ended it (EOS, max_tokens=1, ...)
                        self.send(TokenOutput(msg.request_id, [], True, out.outputs[0].finish_reason))

    def step(self) -> None:
        self.stream_step()

    def abort(self, request_id: str) -> None:
        self.pending = deque(m for m in self.pending if m.request_id != request_id)
        self.engine.abort_request(request_id)
