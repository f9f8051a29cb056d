"""Prefill worker: chunked prefill, KV pushed layer by layer into the decode worker's blocks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import msgspec

from epd.errors import InvalidRequestError
from epd.messages import Message, PrefillDone, PrefillRequest, RequestFailed, TokenLogprob
from epd.roles import Role
from epd.transfer.kv_connector import KVSend
from epd.transfer.kv_sender import NixlKVSender
from epd.transfer.remote_prefix import PrefixPins, RemotePrefixReader, serve_notifications
from epd.workers.engine_worker import EngineWorker


@dataclass(slots=True)
class _Prompt:
    """What the router hears about a finished prompt besides its KV send."""

    first_logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    prefill_s: float = 0.0
    forward_end: float = 0.0


class PrefillWorker(EngineWorker):
    """Runs prompts to their first token and moves their KV to a decode worker.

    A message adapter around the KV connector's sender (``epd.transfer.kv_connector``):
    during the step that completes a prompt it writes each layer's KV as soon as
    that layer is stored, holds the prompt's blocks until every write completed,
    then notifies the decode worker (``KVReady``) — never before: decode never runs
    on partial KV — and this worker tells the router (``PrefillDone``). A write that
    fails or passes ``kv_timeout_s`` is reported as a retryable ``kv_transfer`` failure.

    Remote prefix reads (``epd.transfer.remote_prefix``): a request naming a
    ``prefix_holder`` first reads the prefix blocks that other prefill instance holds
    (``prefix_reader``), and this worker pins its own blocks for other instances' reads
    (``prefix_pins``).
    """

    role = Role.PREFILL

    def __init__(self, args) -> None:
        super().__init__(args)
        self.kv = NixlKVSender(self.transport, self.kv_layout, self.peers, self.staging, args.tp, self.instance_id,
                               free_blocks=self.engine.block_manager.free, fenced=self.frozen_since,
                               timeout_s=args.kv_timeout_s, runner=self.kv_runner)
        self.engine.kv_connector = self.kv
        self.prompts: dict[str, _Prompt] = {}
        self.waiting_staging: deque[tuple[PrefillRequest, float]] = deque()  # staged KV, no staging room yet
        bm = self.engine.block_manager
        self.prefix_reader = RemotePrefixReader(self.transport, bm, self.kv_layout, self.peers, self.instance_id,
                                                args.kv_timeout_s)
        self.prefix_pins = PrefixPins(self.transport, bm, self.instance_id)
        self.kv.between_layers = self._serve_prefix_notifs  # a busy holder answers within a layer
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message, arrival: float | None = None) -> None:
        if not isinstance(msg, PrefillRequest):
            return super().handle_role(msg)
        arrival = arrival or time.monotonic()
        try:
            if not self.kv.add(msg, arrival):
                self.waiting_staging.append((msg, arrival))
                return
            if msg.prefix_holder and self.prefix_reader.start(msg, arrival):
                return  # admitted once its prefix was read (poll)
        except Exception as e:  # every failure is reported, saying who failed
            self.admit_failed(msg, e)
            return
        self._fetch_or_fail(msg)

    def _fetch_or_fail(self, msg: PrefillRequest) -> None:
        try:
            self.fetch_then_admit(msg, msg.encode_instance, list(msg.embeddings), list(msg.placeholders))
        except Exception as e:  # every failure is reported, saying who failed
            self.admit_failed(msg, e)

    def _serve_prefix_notifs(self) -> None:
        serve_notifications(self.transport, self.prefix_reader, self.prefix_pins)

    def admit(self, msg: PrefillRequest, embeddings: list) -> None:
        # The first token only; decode continues. The copy keeps num_prior_output_tokens: a
        # migrated request's penalties and seeded generator see its earlier output here too.
        params = msgspec.structs.replace(msg.params, max_tokens=1, ignore_eos=True, stop_token_ids=[])
        kw = {}
        if msg.placeholders:
            kw = {"mm_placeholders": list(msg.placeholders), "mm_embeddings": embeddings}
        self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), params, **kw)
        self.prompts[msg.request_id] = _Prompt()

    def admit_failed(self, msg: PrefillRequest, exc: BaseException) -> None:
        if not self.kv.abort(msg.request_id):  # not taken: still tell the decode side nothing will come
            self.kv.decline(msg)
        self.fail(msg.request_id, exc)

    def step(self) -> None:
        t0 = time.monotonic()
        for out in self.engine.step():
            prompt = self.prompts.get(out.request_id)
            if prompt is None or not out.finished:
                continue
            comp = out.outputs[0]
            if comp.finish_reason == "error" and isinstance(comp.stop_reason, str):  # its grammar did not compile
                self.prompts.pop(out.request_id, None)
                self.kv.abort(out.request_id)
                self.fail(out.request_id, InvalidRequestError(comp.stop_reason, "structured_outputs"))
                continue
            if out.outputs[0].logprobs:
                prompt.first_logprob = TokenLogprob.from_output(out.outputs[0].logprobs[0])
            prompt.num_cached_tokens = out.num_cached_tokens
            prompt.num_prompt_tokens = len(out.prompt_token_ids)
            prompt.forward_end = time.monotonic()
            prompt.prefill_s = prompt.forward_end - (self.kv.prefill_start(out.request_id) or t0)
        self._finish_sends()

    def poll(self) -> None:
        super().poll()
        self._serve_prefix_notifs()
        for msg, _ in self.prefix_reader.poll():
            self._fetch_or_fail(msg)
        while self.waiting_staging and self.kv.has_room(self.waiting_staging[0][0]):
            msg, arrival = self.waiting_staging.popleft()
            self.handle_role(msg, arrival)
        self._finish_sends()

    def _finish_sends(self) -> None:
        done, failed = self.kv.poll()
        now = time.monotonic()
        for send, error in failed:
            self.prompts.pop(send.request_id, None)
            self.count("kv_transfer_failures")
            self.send(RequestFailed(send.request_id, self.instance_id, error, retryable=True, kind="kv_transfer",
                                    status=503))
        for send in done:
            self._report(send, self.prompts.pop(send.request_id, None) or _Prompt(), now)

    def _report(self, send: KVSend, prompt: _Prompt, now: float) -> None:
        start = send.prefill_start or now
        self.observe("kv_transfer", now - send.send_start)
        self.observe("prefill", prompt.prefill_s)
        self.count("prompt_tokens", prompt.num_prompt_tokens)
        self.observe("prefill_queue", start - send.arrival)
        self.count("kv_transfer_bytes", send.kv_bytes)
        self.send(PrefillDone(send.request_id, self.instance_id, send.first_token, prompt.num_cached_tokens,
                              send.kv_bytes, now - send.send_start, prompt.prefill_s, start - send.arrival,
                              send.num_writes, max(0.0, now - prompt.forward_end), send.write_s,
                              first_logprob=prompt.first_logprob))

    def abort(self, request_id: str) -> None:
        # Between steps: no write of this request is in flight once its transfers are released.
        self.engine.abort_request(request_id)
        self.fetcher.abort(request_id)
        self.prefix_reader.abort(request_id)
        self.prompts.pop(request_id, None)
        if not self.kv.abort(request_id):
            for msg, _ in [w for w in self.waiting_staging if w[0].request_id == request_id]:
                self.kv.decline(msg)
        self.waiting_staging = deque(w for w in self.waiting_staging if w[0].request_id != request_id)

    def in_flight(self) -> set[str]:
        return (super().in_flight() | set(self.prompts) | set(self.kv.sends) | self.prefix_reader.in_flight()
                | {m.request_id for m, _ in self.waiting_staging})

    def peer_gone(self, instance_id: str, pid: int) -> None:
        """A holder's reads fall back to prefill; a reader's pins end."""
        self.prefix_reader.holder_gone(instance_id)
        self.prefix_pins.reader_gone(instance_id, pid)

    def router_lost(self) -> None:
        """Abort everything, then tell every decode peer that nothing the old router
        asked of this worker will ever write (``KVWriterFenced``): commands from one
        router arrive in order and were all read before its loss was noticed."""
        super().router_lost()
        self.kv.fence_all()

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **self.kv.stats(), **self.prefix_reader.stats(), **self.prefix_pins.stats(),
                "num_waiting_staging": len(self.waiting_staging)}
