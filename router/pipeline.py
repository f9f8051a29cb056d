"""The stages one attempt of a request goes through, over the E, P and D pools.

An attempt runs under its own wire request id (see ``epd.router.recovery``):
``begin`` opens its queue in the mailbox, ``end`` aborts it on every worker it
touched (when it did not finish) and forgets it. Its stages:

- **encode** (requests with media items, and transcriptions): one encode
  worker turns the items into embeddings (or transcripts), kept there for the
  prefill side to pull over NIXL; a long video may be split in chunks of
  temporal patches over several encoders (``epd.router.encode_split``), and
  the prefill side then reads from each.
- **disaggregated** (prefill and decode pools): ``ReserveKV`` on a decode
  worker, then ``PrefillRequest`` on a prefill worker, which computes the
  prompt and writes its KV straight into the reserved blocks (first reading the
  prefix blocks another prefill instance holds, when the KV index says one holds
  more of it: ``prefix_holder``); ``PrefillDone``
  carries the first token, and the decode worker streams the rest (its first
  tokens may overtake ``PrefillDone``: they are stashed and put back in order).
- **aggregated** (a ``pd`` pool): ``GenerateRequest`` on one engine that
  prefills and decodes; the same path serves a decode worker recomputing a
  prompt whose KV transfer failed (``role="decode"``).
- **speech** (the tts pool, on its own wire id per phrase): ``SynthesizeRequest``
  on one tts worker, which streams ``AudioChunk`` messages until the ``final`` one.

Every wait has a deadline and watches the workers the stage depends on (the
mailbox's ``expect``). Each stage moves the request's ``RequestState`` (the
states are defined in ``epd.router.request``). Each pick goes through the
pool's routing policy (``epd.router.policies``) and is counted.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import msgspec

from epd.messages import (
    Abort,
    AudioChunk,
    EmbeddingRef,
    EncodeDone,
    EncodeRequest,
    GenerateRequest,
    KVReserved,
    PrefillDone,
    PrefillRequest,
    ReserveKV,
    SynthesizeRequest,
    TokenOutput,
)
from epd.roles import Role
from epd.router.encode_split import plan_encode
from epd.router.kv_index import KVIndex, request_block_hashes
from epd.router.mailbox import Mailbox
from epd.router.policies import NoInstanceError, RoutingPolicy, prefix_holder
from epd.router.registry import PoolRegistry, WorkerHandle
from epd.router.request import RequestError, RequestState, RequestStates, RouterRequest, TokenEvent

#: the sample rate of the audio the tts pool sends (OpenAI realtime's PCM16 at 24 kHz)
TTS_SAMPLE_RATE = 24000

PREFILL_STATS = ("kv_bytes", "kv_transfer_s", "kv_exposed_s", "kv_write_s", "prefill_s", "queue_s",
                 "num_transfer_requests")


class Pipeline:
    """Runs attempts through the pools.

    ``touched``: wire id -> instances the attempt was sent to (they get ``Abort``);
    ``owner``: wire id -> the client request id its state is kept under.
    """

    def __init__(self, registry: PoolRegistry, mailbox: Mailbox, policies: dict[str, RoutingPolicy],
                 states: RequestStates, metrics: Callable[[], object], *, stage_timeout_s: float,
                 token_timeout_s: float, video_encode_split: str = "auto", kv_index: KVIndex | None = None,
                 remote_prefix_reads: bool = True) -> None:
        self.registry = registry
        self.kv_index = kv_index
        self.remote_prefix_reads = remote_prefix_reads and kv_index is not None
        self.video_encode_split = video_encode_split
        self.mailbox = mailbox
        self.policies = policies
        self.states = states
        self._metrics = metrics
        self.stage_timeout_s = stage_timeout_s
        self.token_timeout_s = token_timeout_s
        self.touched: dict[str, set[str]] = {}
        self.owner: dict[str, str] = {}
        # wire id -> (instance, pid) of the prefill worker told to write into a decode
        # reservation and not yet heard back from: its Abort to the decode worker names
        # it, so the reserved blocks stay fenced until that writer is done or gone.
        self.kv_writer: dict[str, tuple[str, int]] = {}

    # ---- attempts -------------------------------------------------------------------
    def begin(self, wire: str, request_id: str) -> None:
        """Open attempt ``wire`` of client request ``request_id``."""
        self.mailbox.open(wire)
        self.touched[wire] = set()
        self.owner[wire] = request_id

    def end(self, wire: str, abort: bool) -> None:
        """Close attempt ``wire``; with ``abort``, send ``Abort`` to every worker it touched."""
        if abort:
            self.abort_everywhere(wire)
        self.mailbox.close(wire)
        self.touched.pop(wire, None)
        self.owner.pop(wire, None)
        self.kv_writer.pop(wire, None)

    def abort_everywhere(self, rid: str) -> None:
        writer, pid = self.kv_writer.get(rid, ("", 0))
        for inst in self.touched.get(rid, ()):
            w = self.registry.get(inst)
            if w is not None:
                w.try_send(Abort(rid, writer, pid))

    def _enter(self, rid: str, state: RequestState) -> None:
        self.states.enter(self.owner.get(rid, rid), state)

    def pick(self, role: str, req: RouterRequest | None = None,
             avoid: set[str] | frozenset = frozenset()) -> WorkerHandle:
        """A live instance of ``role`` for ``req``, preferring instances not in ``avoid``
        (those that already failed this request). Raises RequestError (503) when the
        pool has no live instance."""
        alive = self.registry.routable(role)
        candidates = [w for w in alive if w.instance_id not in avoid] or alive
        policy = self.policies[role]
        try:
            w = policy.select(candidates, req)
        except NoInstanceError:
            raise RequestError(f"no live {role} instance: the {role} pool is down", status=503) from None
        self._metrics().routing_decisions.labels(pool=role, instance=w.instance_id, policy=policy.name).inc()
        return w

    def _touch(self, rid: str, role: str, req: RouterRequest, avoid) -> WorkerHandle:
        """``pick`` a ``role`` instance for attempt ``rid`` and remember it was touched."""
        w = self.pick(role, req, avoid)
        self.touched[rid].add(w.instance_id)
        return w

    async def run(self, req: RouterRequest, avoid: set[str], recompute: bool) -> AsyncIterator[TokenEvent]:
        """One attempt of ``req`` (its wire id is ``req.request_id``): encode, then the
        aggregated or disaggregated path; ``recompute``: the decode worker prefills."""
        e_id, refs, _ = await self.encode(req, avoid)
        placeholders = list(req.placeholders)
        if recompute:
            gen = self.generate_aggregated(req, None, [], [], avoid, role=Role.DECODE)
        elif self.registry.has_pool(Role.PD):
            gen = self.generate_aggregated(req, e_id, refs, placeholders, avoid)
        else:
            gen = self.generate_disaggregated(req, e_id, refs, placeholders, avoid)
        async for ev in gen:
            yield ev

    # ---- stages ---------------------------------------------------------------------
    async def encode(self, req: RouterRequest, avoid: set[str] | frozenset = frozenset()
                     ) -> tuple[str | None, list[EmbeddingRef], list[str]]:
        """The encode stage: (the policy's encode instance, embedding refs in item order,
        transcripts); nothing to do for a request without media items.

        The items go to the policy's pick, except the chunks of a long video split across
        the pool (``epd.router.encode_split``); every instance sent a share is touched (it
        gets ``Abort``) and watched, and each ref names the instance holding it.

        Raises:
            RequestError: a worker's failure, the deadline (``stage_timeout_s`` for all
                the shares), a watched encoder's death (retryable: the next attempt avoids
                it), or an EncodeDone that is not one ref per item sent (500).
        """
        if not req.items:
            return None, [], []
        rid = req.request_id
        self._enter(rid, RequestState.ENCODE)
        e = self._touch(rid, Role.ENCODE, req, avoid)
        alive = self.registry.routable(Role.ENCODE)
        candidates = [w.instance_id for w in alive if w.instance_id not in avoid] or [e.instance_id]
        shares = plan_encode(list(req.items), e.instance_id, candidates, self.video_encode_split)
        workers = {sh.instance_id: self.registry.get(sh.instance_id) for sh in shares}
        for inst, w in workers.items():
            if w is not e:
                self.touched[rid].add(inst)
                self._metrics().routing_decisions.labels(pool=Role.ENCODE, instance=inst, policy="video-split").inc()
        pending = dict(workers)
        for w in pending.values():
            w.inflight += 1
        try:
            for sh in shares:
                ranges = sh.temporal_ranges if any(r is not None for r in sh.temporal_ranges) else []
                workers[sh.instance_id].send(EncodeRequest(rid, sh.items, ranges))
            dones: dict[str, EncodeDone] = {}
            deadline = time.monotonic() + self.stage_timeout_s
            while pending:
                done = await self.mailbox.expect(rid, (EncodeDone,), max(0.0, deadline - time.monotonic()),
                                                 "encode", watch=tuple(pending.values()))
                if done.instance_id in pending:
                    dones[done.instance_id] = done
                    del pending[done.instance_id]
        finally:
            for w in workers.values():
                w.inflight -= 1
        refs: dict[tuple[int, int], EmbeddingRef] = {}
        for sh in shares:
            done = dones[sh.instance_id]
            if len(done.embeddings) != len(sh.items) and not done.transcripts:
                raise RequestError(f"{sh.instance_id} sent {len(done.embeddings)} embeddings for "
                                   f"{len(sh.items)} items", status=500, instance=sh.instance_id)
            for slot, ref, rng in zip(sh.slots, done.embeddings, sh.temporal_ranges):
                refs[slot] = msgspec.structs.replace(ref, instance_id=sh.instance_id, temporal_range=rng)
        # transcripts come from the pick (audio is never split); with more encoders than a
        # video's temporal patches the pick may have had no chunk of it
        transcripts = dones[e.instance_id].transcripts if e.instance_id in dones else []
        return e.instance_id, [refs[k] for k in sorted(refs)], list(transcripts)

    async def synthesize(self, rid: str, text: str, voice: str, avoid: set[str] | frozenset = frozenset()
                         ) -> AsyncIterator[bytes]:
        """The speech stage: the PCM16 bytes of ``text`` from one tts worker, chunk by
        chunk. Raises RequestError: the worker's failure, a deadline (the first chunk
        within ``stage_timeout_s``, each next within ``token_timeout_s``), its death, or
        a malformed chunk (500)."""
        self._enter(rid, RequestState.SPEECH)
        t = self._touch(rid, Role.TTS, None, avoid)
        t.inflight += 1
        try:
            t.send(SynthesizeRequest(rid, text, voice))
            timeout = self.stage_timeout_s
            while True:
                chunk = await self.mailbox.expect(rid, (AudioChunk,), timeout, "speech synthesis", watch=(t,))
                if len(chunk.pcm) % 2 or chunk.sample_rate != TTS_SAMPLE_RATE:
                    raise RequestError(f"{t.instance_id} sent a malformed audio chunk ({len(chunk.pcm)} bytes at "
                                       f"{chunk.sample_rate} Hz; expected PCM16 at {TTS_SAMPLE_RATE} Hz)",
                                       status=500, instance=t.instance_id)
                if chunk.pcm:
                    yield chunk.pcm
                if chunk.final:
                    return
                timeout = self.token_timeout_s
        finally:
            t.inflight -= 1

    async def generate_aggregated(self, req, e_id, refs, placeholders, avoid=frozenset(),
                                  role: Role = Role.PD) -> AsyncIterator[TokenEvent]:
        """The whole request on one engine: a ``pd`` worker, or (``role="decode"``)
        a decode worker recomputing a prompt whose KV transfer failed."""
        rid = req.request_id
        w = self._touch(rid, role, req, avoid)
        self._enter(rid, RequestState.PREFILL)
        w.inflight += 1
        try:
            w.send(GenerateRequest(rid, req.prompt_token_ids, req.params, placeholders, e_id, refs))
            async for ev in self.stream(rid, first_timeout_s=self.stage_timeout_s, watch=(w,)):
                yield ev
        finally:
            w.inflight -= 1
            self.policies[role].released(w, rid)

    async def generate_disaggregated(self, req, e_id, refs, placeholders, avoid=frozenset()
                                     ) -> AsyncIterator[TokenEvent]:
        """Reserve KV on a decode worker, prefill into it, stream from it. The prefill
        instance is picked first: the reservation names it as the only writer whose
        notifications the decode worker accepts."""
        rid = req.request_id
        p = self._touch(rid, Role.PREFILL, req, avoid)
        d = self._touch(rid, Role.DECODE, req, avoid)
        d.inflight += 1
        try:
            self._enter(rid, RequestState.PREFILL)
            d.send(ReserveKV(rid, req.prompt_token_ids, req.params, placeholders, kv_writer=p.instance_id))
            reserved = await self.mailbox.expect(rid, (KVReserved,), self.stage_timeout_s, "KV reservation",
                                                 watch=(d,))
            self.policies[Role.DECODE].reserved(d, rid)  # its next load reports include the blocks
            done, early = await self._prefill(req, p, d, reserved, e_id, refs, placeholders)
            self._enter(rid, RequestState.TRANSFER)
            for msg in reversed(early):  # put the overtaking tokens back in front, in order
                self.mailbox.requeue_front(rid, msg)
            stats = {k: getattr(done, k) for k in PREFILL_STATS}
            yield TokenEvent([done.first_token], False, None, done.num_cached_tokens, stats,
                             [done.first_logprob] if done.first_logprob is not None else [])
            async for ev in self.stream(rid, first_timeout_s=self.token_timeout_s,
                                        num_cached_tokens=done.num_cached_tokens, watch=(d,)):
                yield ev
        finally:
            d.inflight -= 1
            self.policies[Role.DECODE].released(d, rid)

    async def _prefill(self, req, p: WorkerHandle, d: WorkerHandle, reserved: KVReserved, e_id, refs, placeholders
                       ) -> tuple[PrefillDone, list[TokenOutput]]:
        """Prefill ``req`` on ``p`` into ``d``'s reserved blocks: its PrefillDone, and
        the decode worker's tokens that overtook it."""
        rid = req.request_id
        p.inflight += 1
        try:
            self.kv_writer[rid] = (p.instance_id, p.info.pid)
            p.send(PrefillRequest(rid, req.prompt_token_ids, req.params, d.instance_id,
                                  list(reserved.block_ids), placeholders, e_id, refs,
                                  decode_staging_block=reserved.staging_block,
                                  decode_generation=reserved.generation,
                                  decode_num_cached_blocks=reserved.num_cached_blocks,
                                  **self.prefix_holder(p, req)))
            early: list[TokenOutput] = []
            done = await self.mailbox.expect(rid, (PrefillDone,), self.stage_timeout_s, "prefill", stash=early,
                                             watch=(p, d))
            del self.kv_writer[rid]  # its writes are complete
        except RequestError as e:
            if e.instance == p.instance_id and e.kind not in ("dead", "timeout", "kv_transfer"):
                self.kv_writer.pop(rid, None)  # it reported the failure: it writes nothing more
            # (a failed KV transfer's writes may still be in flight: its KVWriterDone ends the fence)
            raise
        finally:
            p.inflight -= 1
        return done, early

    def prefix_holder(self, p: WorkerHandle, req) -> dict:
        """The ``PrefillRequest`` fields naming the prefill instance ``p`` should read
        ``req``'s prefix blocks from (remote prefix reads, ``epd.router.policies.prefix_holder``)
        and how many it holds; {} for none."""
        layout = p.info.kv_layout
        if not self.remote_prefix_reads or p.role != Role.PREFILL or layout is None or not req.prompt_token_ids:
            return {}
        chain = request_block_hashes(req.prompt_token_ids, layout.block_size, req.placeholders)
        holder, held, _ = prefix_holder(self.kv_index, chain, p, self.registry.routable(Role.PREFILL))
        return {"prefix_holder": holder, "prefix_holder_blocks": held} if holder else {}

    async def stream(self, rid: str, first_timeout_s: float, num_cached_tokens: int = 0,
                     watch: tuple[WorkerHandle, ...] = ()) -> AsyncIterator[TokenEvent]:
        """The decode stage: ``rid``'s tokens as they come, until the finished one."""
        timeout = first_timeout_s
        while True:
            msg = await self.mailbox.expect(rid, (TokenOutput,), timeout, "decode", watch=watch,
                                            move_off_draining=True)
            timeout = self.token_timeout_s
            self._enter(rid, RequestState.DECODE)
            yield TokenEvent(list(msg.token_ids), msg.finished, msg.finish_reason,
                             msg.num_cached_tokens or num_cached_tokens, None, list(msg.logprobs))
            if msg.finished:
                return
