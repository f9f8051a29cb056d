"""Decode worker: reserves blocks, receives prompt KV over NIXL, streams tokens."""

from __future__ import annotations

import time

from epd.messages import Abort, GenerateRequest, Message, ReserveKV, TokenOutput
from epd.roles import Role
from epd.transfer.kv_receiver import NixlKVReceiver
from epd.workers.engine_worker import EngineWorker


class DecodeWorker(EngineWorker):
    """Continuous batching over sequences whose prompt KV another worker wrote.

    A message adapter around the KV connector's receiver (``epd.transfer.kv_connector``):
    ReserveKV -> blocks reserved (or queued until there is room) -> KVReserved;
    the prefill worker's KVReady notification -> the sequence joins the running
    batch -> TokenOutput per generated token. The first token came from prefill
    and is not repeated. An aborted reservation stays fenced until its writer is done or gone.

    A ``GenerateRequest`` (the router's ``recompute`` answer to a failed KV
    transfer) runs the whole request here, prefill included.
    """

    role = Role.DECODE

    def __init__(self, args) -> None:
        super().__init__(args)
        self.kv = NixlKVReceiver(self.engine, self.transport, self.staging, self.instance_id, kv_runner=self.kv_runner)
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message) -> None:
        if isinstance(msg, ReserveKV):
            for reply in self.kv.add(msg):
                self.send(reply)
        elif isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), msg.params)
            except Exception as e:  # every failure is reported, saying who failed
                self.fail(msg.request_id, e)
        else:
            super().handle_role(msg)

    def poll(self) -> None:
        replies, finished = self.kv.poll()
        for reply in replies:
            self.send(reply)
        for out in finished:  # the first token already ended it (EOS, max_tokens=1, ...)
            self.kv.admitted.pop(out.request_id, None)
            self.send(TokenOutput(out.request_id, [], True, out.outputs[0].finish_reason))

    def step(self) -> None:
        now = time.monotonic()
        for out in self.stream_step():  # a request's first decode step ends its decode-queue wait
            admitted = self.kv.admitted.pop(out.request_id, None)
            if admitted is not None:
                self.observe("decode_queue", now - admitted)

    def on_abort(self, msg: Abort) -> None:
        self.kv.abort(msg.request_id, msg.kv_writer, msg.kv_writer_pid)  # a reservation may stay fenced

    def abort(self, request_id: str) -> None:
        self.kv.abort(request_id)

    def in_flight(self) -> set[str]:
        """Live requests; fenced reservations are not (they wait for their writer, not for us)."""
        return (super().in_flight() | self.kv.in_flight()) - self.kv.fenced()

    def router_lost(self) -> None:
        """Drop every request; a reservation its named writer may still write stays
        fenced until that writer's KVWriterDone / KVWriterFenced (or KVReady)."""
        for rid in self.in_flight():
            self.kv.abort(rid, *self.kv.expected_writer(rid))

    def peer_gone(self, instance_id: str, pid: int) -> None:
        self.kv.writer_gone(instance_id, pid)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **self.kv.stats()}
