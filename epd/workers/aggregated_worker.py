"""Aggregated (``pd``) worker: prefill and decode in one engine with chunked prefill — the baseline."""

from __future__ import annotations

from epd.messages import GenerateRequest, Message
from epd.roles import Role
from epd.workers.engine_worker import EngineWorker


class AggregatedWorker(EngineWorker):
    """GenerateRequest -> (embeddings read from the encode worker) -> TokenOutput per token."""

    role = Role.PD

    def __init__(self, args) -> None:
        super().__init__(args)
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message) -> None:
        if not isinstance(msg, GenerateRequest):
            return super().handle_role(msg)
        try:
            self.fetch_then_admit(msg, msg.encode_instance, list(msg.embeddings), list(msg.placeholders))
        except Exception as e:  # every failure is reported, saying who failed
            self.fail(msg.request_id, e)

    def admit(self, msg: GenerateRequest, embeddings: list) -> None:
        kw = {}
        if msg.placeholders:
            kw = {"mm_placeholders": list(msg.placeholders), "mm_embeddings": embeddings}
        self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), msg.params, **kw)

    def step(self) -> None:
        self.stream_step()

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.fetcher.abort(request_id)
