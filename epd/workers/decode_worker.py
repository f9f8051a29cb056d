"""Decode worker: reserves blocks, receives prompt KV over NIXL, streams tokens."""

from __future__ import annotations

from epd.errors import InvalidRequestError
from epd.messages import GenerateRequest, Message, RequestFailed, ReserveKV, TokenOutput
from epd.roles import Role
from epd.transfer.kv_connector import NixlKVReceiver
from epd.workers.engine_worker import EngineWorker


class DecodeWorker(EngineWorker):
    """Continuous batching over sequences whose prompt KV another worker wrote.

    A message adapter around the KV connector's receiver (``epd.transfer.kv_connector``):
    ReserveKV -> blocks reserved (or queued until there is room) -> KVReserved;
    the prefill worker's KVReady notification -> the sequence joins the running
    batch -> TokenOutput per generated token. The first token came from prefill
    and is not repeated. Aborted reservations are fenced for ``QUARANTINE_S``.

    A ``GenerateRequest`` (the router's ``recompute`` answer to a failed KV
    transfer) runs the whole request here, prefill included.
    """

    role = Role.DECODE
    QUARANTINE_S = 1.0

    def __init__(self, args) -> None:
        super().__init__(args)
        self.kv = NixlKVReceiver(self.engine, self.transport, self.staging, self.instance_id,
                                 quarantine_s=self.QUARANTINE_S)
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message) -> None:
        if isinstance(msg, ReserveKV):
            for reply in self.kv.add(msg):
                self.send(reply)
        elif isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), msg.params)
            except (InvalidRequestError, ValueError) as e:
                self.send(RequestFailed(msg.request_id, self.instance_id, str(e)))
        else:
            super().handle_role(msg)

    def poll(self) -> None:
        replies, finished = self.kv.poll()
        for reply in replies:
            self.send(reply)
        for out in finished:  # the first token already ended it (EOS, max_tokens=1, ...)
            self.send(TokenOutput(out.request_id, [], True, out.outputs[0].finish_reason))

    def step(self) -> None:
        self.stream_step()

    def abort(self, request_id: str) -> None:
        self.kv.abort(request_id)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **self.kv.stats()}
