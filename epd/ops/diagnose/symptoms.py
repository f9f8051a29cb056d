"""What ``epd diagnose`` can find: the symptoms (:data:`SYMPTOMS`), a check's outcome
(:class:`Check`) and the settings the checks take (:class:`Settings`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from epd.ops.diagnose.format import json_safe
from epd.ops.diagnose.thresholds import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S

__all__ = ["STATUSES", "SYMPTOMS", "Check", "Settings"]


#: id -> (title, likely cause, fix to try); the ids are stable (``--json``, ``--ignore``)
SYMPTOMS: dict[str, tuple[str, str, str]] = {
    "prefill_steals_decode": (
        "decode ITL spikes on an aggregated pool: prefill steals decode steps",
        "long prompts are prefilled in the same engine steps as the running decodes, so every stream "
        "stalls while a prompt's chunk computes",
        "disaggregate (--pools p:N,d:M), or bound the prefill tokens of a step that carries decodes "
        "(lower --target-step-ms or --max-prefill-tokens-with-decodes)"),
    "prefill_queue_dominates_ttft": (
        "TTFT is made of prefill queueing: the prefill queue dominates prefill execution",
        "the prefill pool is saturated: requests wait for a prefill instance much longer than they compute",
        "add prefill instances (--pools p:N+1,...)"),
    "decode_tpot_jitter": (
        "TPOT/ITL jitter while TTFT is fine: decode steps are slow or the KV cache is full",
        "decode steps vary (a large batch or long contexts), or the decode KV cache is nearly full",
        "add decode instances, cap the context (--max-model-len), or quantize the KV cache"),
    "kv_transfer_slow": (
        "P->D KV transfer slow or failing",
        "the transport is slow or falls back (e.g. UCX over tcp instead of RDMA/NVLink/shared memory), "
        "or the decode peer is far away",
        "use RDMA or NVLink (UCX_TLS, --ucx-net-devices), place prefill and decode in the same zone/node"),
    "prefill_budget_small": (
        "prefill queue high while the prefill batch is under-used: the step token budget is too small",
        "prompts are prefilled one at a time, each over several steps (the step token budget holds "
        "less than a prompt or two), while the others queue",
        "raise the step token budget (--max-num-batched-tokens) toward the prompt length"),
    "decode_kv_short": (
        "decode KV cache short: preemptions, or a long decode queue",
        "the decode pool's KV cache cannot hold the running batch: sequences are preempted (recomputed) "
        "or wait for blocks",
        "add decode instances, lower --max-num-seqs, give the KV cache more memory "
        "(--kv-cache-memory-gb), or quantize the KV cache"),
    "goodput_low": (
        "goodput far below throughput: few requests meet both the TTFT and the TPOT SLO",
        "the SLOs and the workload mix do not fit this deployment",
        "scale the pool whose SLO fails (TTFT: prefill, TPOT: decode), relax the SLO, or serve the long "
        "prompts on their own deployment"),
    "prefix_cache_miss": (
        "prefix-cache hit rate under 10%",
        "if prompts repeat (system prompts, few-shot examples, multi-turn history): unstable templates "
        "(per-request text such as a date or an id before the shared part) or routing that ignores the "
        "cache; or capacity: blocks are evicted before they are hit again (the host tier's drops say "
        "so); prompts that never repeat miss by nature (then --ignore prefix_cache_miss)",
        "keep the shared part first and byte-identical; route by prefix (--prefill-routing kv); for "
        "capacity, add a host tier (--kv-host-cache-gb) or KV memory"),
    "pool_ratio_mismatch": (
        "pools scaled out of proportion to the input/output token work",
        "one pool is overloaded while the other idles: the prefill:decode instance ratio does not match "
        "the work of the input and output tokens",
        "move instances to the overloaded pool (see the suggested --pools)"),
    "cancel_leak": (
        "cancelled requests whose KV blocks were not returned: leak suspected",
        "blocks of aborted requests (client disconnects) stay allocated on an idle worker",
        "report it with /epd/workers' output; restarting the worker frees its cache"),
}

#: a check's outcome: found, fine, its pool not deployed, or not judged (missing or too few observations)
STATUSES = ("symptom", "ok", "not_applicable", "not_evaluated")


@dataclass(slots=True)
class Check:
    """The outcome of one symptom check for one pool (``pool`` None: the deployment).

    ``status``: one of :data:`STATUSES`; ``detail``: the evidence (or why it was not
    evaluated) in words; ``evidence``: the numbers behind it (seconds, ratios 0..1, counts)."""

    id: str
    status: str
    pool: str | None = None
    detail: str = ""
    evidence: dict[str, float | str] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The check as JSON: its fields (NaN/inf evidence as null), and a symptom's title, cause and fix."""
        d = asdict(self)
        d["evidence"] = {k: json_safe(v) for k, v in self.evidence.items()}
        if self.status == "symptom":
            d["title"], d["cause"], d["fix"] = SYMPTOMS[self.id]
        return d


@dataclass(frozen=True, slots=True)
class Settings:
    """SLOs of the goodput check, seconds."""

    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
