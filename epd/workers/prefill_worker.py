"""Prefill worker: chunked prefill, KV pushed layer by layer into the decode worker's blocks."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

from epd.engine.model_runner import StepKV
from epd.engine.scheduler import SchedulerOutput
from epd.errors import InvalidRequestError
from epd.messages import KVReady, Message, PrefillDone, PrefillRequest, RequestFailed, TokenLogprob, encode
from epd.transfer.nixl_transport import Transfer, TransferError
from epd.workers.engine_worker import EngineWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    req: PrefillRequest
    arrival: float
    start: float = 0.0
    transfers: list[Transfer] = field(default_factory=list)
    send_start: float = 0.0
    first_token: int | None = None
    num_cached_tokens: int = 0
    prefill_s: float = 0.0
    kv_bytes: int = 0
    forward_end: float = 0.0
    write_s: float = 0.0  # time spent inside write() calls (on CPU, cma copies synchronously there)
    first_logprob: TokenLogprob | None = None
    staging_block: int = -1  # first block of this job's range in our staging pool (staged KV)


class PrefillWorker(EngineWorker):
    """Runs prompts to their first token and moves their KV to a decode worker.

    During the step that completes a prompt, a per-layer hook issues one NIXL
    write per layer (all of the sequence's blocks, K and V) as soon as that
    layer's K/V is stored, so transfers overlap the remaining layers' compute.
    The sequence's blocks are held until every write completes; then the
    decode worker gets a ``KVReady`` notification (never before: decode never
    runs on partial KV) and the router a ``PrefillDone``. A write that fails or
    passes ``kv_timeout_s`` is released and reported as a retryable failure.
    """

    role = "prefill"

    def __init__(self, args) -> None:
        super().__init__(args)
        self.engine.hold_finished_blocks = True
        self.jobs: dict[str, _Job] = {}
        self.waiting_staging: deque[tuple[PrefillRequest, float]] = deque()  # staged KV, no staging room yet
        # Fault injection for recovery tests: the first N requests' KV writes fail
        # as a dead link would (TransferError), exercising --kv-failure-policy.
        self.inject_kv_failures = int(os.environ.get("EPD_INJECT_KV_FAILURES", "0") or 0)
        self.announce(self.regions, self.kv_layout)

    def handle_role(self, msg: Message, arrival: float | None = None) -> None:
        if not isinstance(msg, PrefillRequest):
            return super().handle_role(msg)
        rid = msg.request_id
        job = _Job(msg, arrival or time.monotonic())
        try:
            if msg.decode_instance not in self.peers:
                raise InvalidRequestError(f"unknown decode instance {msg.decode_instance!r}")
            if not self._reserve_staging(job):
                self.waiting_staging.append((msg, job.arrival))
                return
            embeddings = self.fetch_embeddings(rid, msg.encode_instance, list(msg.embeddings))
            params = msg.params.to_params()
            params.max_tokens = 1  # the first token; decode continues
            params.ignore_eos = True
            params.stop_token_ids = []
            kw = {}
            if msg.placeholders:
                kw = {"mm_placeholders": self.placeholders(list(msg.placeholders)), "mm_embeddings": embeddings}
            self.engine.add_request(rid, list(msg.prompt_token_ids), params, **kw)
        except (InvalidRequestError, ValueError, KeyError, TransferError) as e:
            if self.staging is not None:
                self.staging.free(rid)
            self.send(RequestFailed(rid, self.instance_id, str(e), retryable=isinstance(e, TransferError)))
            return
        self.jobs[rid] = job

    def _reserve_staging(self, job: _Job) -> bool:
        """Take a staging range for a job whose KV goes through staging (heterogeneous
        TP: the decode instance reserved a staging range). False: no room right now.

        Raises:
            InvalidRequestError: the TP pair needs staging that one side lacks.
            StagingPoolError (a ValueError): the prompt can never fit the staging pool.
        """
        req = job.req
        d = self.peers[req.decode_instance].kv_layout
        if req.decode_staging_block < 0:
            if self.args.tp != 1 or d.tp != 1:
                raise InvalidRequestError(
                    f"prefill TP {self.args.tp} -> decode TP {d.tp} needs staged KV, but decode instance "
                    f"{req.decode_instance} reserved no staging range (start it with --kv-staging-mb > 0)")
            return True
        if self.staging is None:
            raise InvalidRequestError(
                f"decode instance {req.decode_instance} expects staged KV, but prefill instance {self.instance_id} "
                f"has no staging pool (start it with --kv-staging-mb > 0)")
        if d.staging_block_bytes != self.staging.region(0, 0, 1)[1]:
            raise InvalidRequestError(f"decode instance {req.decode_instance} stages a different KV layout")
        start = self.staging.alloc(req.request_id, len(req.decode_block_ids))
        if start is None:
            return False
        job.staging_block = start
        return True

    def _layer_hook(self, sched: SchedulerOutput):
        now = time.monotonic()
        for s in sched.scheduled:  # a job's prefill starts with its first scheduled chunk
            job = self.jobs.get(s.seq.request_id)
            if job is not None and not job.start:
                job.start = now
        finishing = [(s.seq, self.jobs[s.seq.request_id]) for s in sched.scheduled
                     if s.sample and s.seq.request_id in self.jobs]
        if not finishing:
            return None
        k_base = [r[0] for r in self.kv_layout.k_regions]
        v_base = [r[0] for r in self.kv_layout.v_regions]
        bb = self.block_bytes
        plans = []
        packs = []  # staged jobs: every rank packs its head slice into the job's staging range
        for seq, job in finishing:
            d = self.peers[job.req.decode_instance].kv_layout
            n = len(job.req.decode_block_ids)
            src, dst = seq.block_table[:n], list(job.req.decode_block_ids)
            plans.append((job, src, dst, d))
            if job.staging_block >= 0:
                packs.append((job.staging_block, src))

        def regions(layer: int, job: _Job, src: list[int], dst: list[int], d) -> tuple[list, list]:
            """(local, remote) descriptors of one job's layer: one contiguous staging
            range when staged (one request per layer, any block count), else every block."""
            if job.staging_block >= 0:
                local = self.staging.region(layer, job.staging_block, len(src))
                remote = (d.staging_regions[layer][0] + job.req.decode_staging_block * d.staging_block_bytes,
                          local[1], 0)
                return [local], [remote]
            dk, dv = d.k_regions[layer][0], d.v_regions[layer][0]
            local = [(k_base[layer] + b * bb, bb, 0) for b in src] + [(v_base[layer] + b * bb, bb, 0) for b in src]
            remote = [(dk + b * bb, bb, 0) for b in dst] + [(dv + b * bb, bb, 0) for b in dst]
            return local, remote

        def hook(layer: int) -> None:
            for job, src, dst, d in plans:
                t0 = time.monotonic()
                if not job.send_start:
                    job.send_start = t0
                if self.frozen_since(job.arrival):  # fenced: the router may already have retried it elsewhere
                    job.transfers.append(None)  # type: ignore[arg-type]
                    continue
                local, remote = regions(layer, job, src, dst, d)
                try:
                    if self.inject_kv_failures > 0 and layer == 0:
                        self.inject_kv_failures -= 1
                        raise TransferError("injected KV write failure (EPD_INJECT_KV_FAILURES)")
                    job.transfers.append(self.transport.write(job.req.decode_instance, local, remote))
                except (TransferError, ValueError) as e:
                    logger.warning("prefill %s: KV write for %s failed: %s", self.instance_id, job.req.request_id, e)
                    job.transfers.append(None)  # type: ignore[arg-type]
                job.kv_bytes += sum(r[1] for r in local)
                job.write_s += time.monotonic() - t0

        return StepKV(hook, packs)

    def step(self) -> None:
        t0 = time.monotonic()
        outs = self.engine.step(layer_hook_factory=self._layer_hook)
        for out in outs:
            job = self.jobs.get(out.request_id)
            if job is None or not out.finished:
                continue
            job.first_token = out.outputs[0].token_ids[0]
            if out.outputs[0].logprobs:
                job.first_logprob = TokenLogprob.from_output(out.outputs[0].logprobs[0])
            job.num_cached_tokens = out.num_cached_tokens
            job.forward_end = time.monotonic()
            job.prefill_s = job.forward_end - (job.start or t0)
        self._finish_sends()

    def poll(self) -> None:
        while self.waiting_staging and self.staging.can_alloc(len(self.waiting_staging[0][0].decode_block_ids)):
            msg, arrival = self.waiting_staging.popleft()
            self.handle_role(msg, arrival)
        self._finish_sends()

    def _finish_sends(self) -> None:
        now = time.monotonic()
        for rid, job in list(self.jobs.items()):
            if job.first_token is None:
                continue
            try:
                if any(t is None for t in job.transfers):
                    raise TransferError(f"KV write to {job.req.decode_instance} could not be issued")
                if not all(t.poll() for t in job.transfers):
                    if now - job.send_start > self.args.kv_timeout_s:
                        raise TransferError(f"KV write to {job.req.decode_instance} passed its "
                                            f"{self.args.kv_timeout_s} s deadline")
                    continue
                self.transport.send_notif(job.req.decode_instance,
                                          encode(KVReady(rid, job.first_token, src_tp=self.args.tp)))
            except TransferError as e:
                self._drop(rid)
                self.count("kv_transfer_failures")
                self.send(RequestFailed(rid, self.instance_id, str(e), retryable=True, kind="kv_transfer"))
                continue
            self._drop(rid)
            self.observe("kv_transfer", now - job.send_start)
            self.observe("prefill", job.prefill_s)
            self.observe("prefill_queue", (job.start or now) - job.arrival)
            self.count("kv_transfer_bytes", job.kv_bytes)
            self.send(PrefillDone(rid, self.instance_id, job.first_token, job.num_cached_tokens, job.kv_bytes,
                                  now - job.send_start, job.prefill_s, (job.start or now) - job.arrival,
                                  len(job.transfers), max(0.0, now - job.forward_end), job.write_s,
                                  first_logprob=job.first_logprob))

    def _drop(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None:
            for t in job.transfers:
                if t is not None:
                    t.release()
        self.engine.abort_request(request_id)  # frees held blocks too
        if self.staging is not None:
            self.staging.free(request_id)

    def abort(self, request_id: str) -> None:
        self.waiting_staging = deque(w for w in self.waiting_staging if w[0].request_id != request_id)
        self._drop(request_id)

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["num_sending"] = sum(1 for j in self.jobs.values() if j.first_token is not None)
        s["num_waiting_staging"] = len(self.waiting_staging)
        return s
