"""Prometheus metrics of every epd process, aggregated with prometheus-client's multiprocess mode.

Every process (API/router, each worker rank) writes its samples into mmap'ed files
in one shared directory, ``$PROMETHEUS_MULTIPROC_DIR``; the API's ``/metrics``
reads them all back with :func:`render_latest`. Order matters:

1. the launcher calls :func:`setup_multiprocess_dir` before it starts any worker
   (children inherit the environment variable) and before any metric object
   exists in its own process;
2. each process calls :func:`get_metrics` (lazy: the metric objects are created on
   the first call, so they see the variable);
3. the launcher calls :func:`mark_process_dead` for every worker it reaps, so that
   live gauges of dead processes disappear (counters and histograms keep the dead
   process's totals, as they should).

Every metric has the labels ``pool`` ("encode", "prefill", "decode", "pd", "tts", or
"router" for what the router observes about the request as a whole) and
``instance`` (an instance id such as "decode-3"). Request-level latencies (TTFT,
TPOT, ITL, e2e) carry the pool and instance that produced the tokens.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

__all__ = [
    "LABELS", "LATENCY_BUCKETS", "TRANSFER_BUCKETS", "STEP_BUCKETS", "Metrics", "setup_multiprocess_dir",
    "multiprocess_dir", "get_metrics", "mark_process_dead", "render_latest",
]

ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = ("pool", "instance")

#: seconds; request-level and per-stage latencies on CPU: 1 ms .. 60 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
#: seconds; per-token / per-step times (TPOT, ITL, one decode step): 1 ms .. 10 s
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.0, 5.0, 10.0)
#: seconds; NIXL transfers near memcpy speed: 50 us .. 10 s
TRANSFER_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# ---- metric names: the one definition, used below to declare the metrics and by the readers of
# /metrics (epd/ops: diagnose, plan). Histograms: the family name (its samples add _bucket, _sum,
# _count); counters: the sample name, ``_total`` included (the family is the name without it);
# gauges: the sample name.
TTFT = "epd_time_to_first_token_seconds"
TPOT = "epd_time_per_output_token_seconds"
ITL = "epd_inter_token_latency_seconds"
E2E = "epd_e2e_request_latency_seconds"
ENCODE_QUEUE = "epd_encode_queue_seconds"
ENCODE = "epd_encode_seconds"
EMBEDDING_TRANSFER = "epd_embedding_transfer_seconds"
PREFILL_QUEUE = "epd_prefill_queue_seconds"
PREFILL = "epd_prefill_seconds"
KV_TRANSFER = "epd_kv_transfer_seconds"
DECODE_QUEUE = "epd_decode_queue_seconds"
DECODE_STEP = "epd_decode_step_seconds"
TTS_QUEUE = "epd_tts_queue_seconds"
TTS_FIRST_AUDIO = "epd_tts_time_to_first_audio_seconds"
TTS_SYNTHESIS = "epd_tts_synthesis_seconds"
KV_BYTES = "epd_kv_transfer_bytes_total"
#: KV bytes a decode instance did not need P -> D: its prefix cache held those blocks
KV_SAVED_BYTES = "epd_kv_transfer_saved_bytes_total"
KV_FAILURES = "epd_kv_transfer_failures_total"
KV_RETRIES = "epd_kv_transfer_retries_total"
#: NIXL operations posted (one per layer and rank of each transfer), not client requests
KV_OPS = "epd_kv_transfer_requests_total"
#: released NIXL transfers not terminated within the bound (their memory stays fenced)
TRANSFERS_UNTERMINATED = "epd_transfers_unterminated_total"
TTS_PHRASES = "epd_tts_phrases_total"
TTS_CHARACTERS = "epd_tts_characters_total"
TTS_AUDIO_SECONDS = "epd_tts_audio_seconds_total"
PREEMPTIONS = "epd_preemptions_total"
CANCELLED = "epd_cancelled_requests_total"
MIGRATED = "epd_migrated_requests_total"
REQUEST_RETRIES = "epd_request_retries_total"
WORKER_FAILURES = "epd_worker_failures_total"
WORKER_RESTARTS = "epd_worker_restarts_total"
PROMPT_TOKENS = "epd_prompt_tokens_total"
PREFIX_QUERIES = "epd_prefix_cache_queries_tokens_total"
PREFIX_HITS = "epd_prefix_cache_hits_tokens_total"
KV_HOST_OFFLOADED = "epd_kv_host_offloaded_blocks_total"
KV_HOST_LOADED = "epd_kv_host_loaded_blocks_total"
KV_HOST_EVICTED = "epd_kv_host_evicted_blocks_total"
KV_HOST_USAGE = "epd_kv_host_cache_usage_ratio"
KV_DISK_STORED = "epd_kv_disk_stored_blocks_total"
KV_DISK_LOADED = "epd_kv_disk_loaded_blocks_total"
KV_DISK_EVICTED = "epd_kv_disk_evicted_blocks_total"
KV_DISK_WRITE_ERRORS = "epd_kv_disk_write_errors_total"
KV_DISK_USAGE = "epd_kv_disk_cache_usage_ratio"
SPEC_DRAFTS = "epd_spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "epd_spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "epd_spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_POS = "epd_spec_decode_num_accepted_tokens_per_pos_total"
REMOTE_PREFIX_READS = "epd_kv_remote_prefix_reads_total"
REMOTE_PREFIX_READ_BYTES = "epd_kv_remote_prefix_read_bytes_total"
KV_PINNED_BLOCKS = "epd_kv_pinned_blocks"
ENCODER_QUERIES = "epd_encoder_cache_queries_total"
ENCODER_HITS = "epd_encoder_cache_hits_total"
ENCODE_VIDEO_CHUNKS = "epd_encode_video_chunks_total"
ROUTED = "epd_routing_decisions_total"
KV_USAGE = "epd_kv_cache_usage_ratio"
QUEUE_DEPTH = "epd_queue_depth"
RUNNING = "epd_running_requests"
QUEUED_PROMPT_TOKENS = "epd_queued_prompt_tokens"
KV_FENCED_BLOCKS = "epd_kv_fenced_blocks"
ROUTER_REQUESTS = "epd_router_requests"
POOL_INSTANCES = "epd_pool_instances"
AUTH_DENIED = "epd_auth_denied_total"


def _family(counter: str) -> str:
    """A counter's family name: its sample name without ``_total``."""
    return counter.removesuffix("_total")



@dataclass(frozen=True)
class Metrics:
    """All epd metric objects; use ``.labels(pool=..., instance=...)`` on each.

    Histograms (seconds):
        time_to_first_token: request arrival at the API to its first output token.
        time_per_output_token: per request, (t_last - t_first) / (n_out - 1).
        inter_token_latency: gap between two consecutive tokens streamed for a request.
        e2e_request_latency: request arrival to its last token (or error).
        encode_queue: encode request received by an E worker to its encode start.
        encode: encoder forward for one encode request (all its items).
        embedding_transfer: P pulling one request's embeddings from E over NIXL.
        prefill_queue: prefill request received by a P worker to its first chunk.
        prefill: a request's prefill compute, first chunk start to first token.
        kv_transfer: P -> D KV transfer of one request, first write to last completion.
        decode_queue: KV ready on D to the request joining the running batch.
        decode_step: one decode engine step (the whole running batch).
        tts_queue: a phrase received by a TTS worker to its synthesis start.
        tts_first_audio: a phrase received by a TTS worker to its first audio chunk sent.
        tts_synthesis: synthesis of one phrase, start to last chunk.

    Counters:
        kv_transfer_bytes: bytes of KV cache moved P -> D (``epd_kv_transfer_bytes_total``).
        kv_transfer_saved_bytes: bytes of prompt KV a decode instance did not receive
            P -> D because its own prefix cache held those blocks (decode-side reuse).
        tts_phrases: phrases a TTS worker spoke.
        tts_characters: characters of those phrases.
        tts_audio_seconds: seconds of audio a TTS worker synthesized.
        kv_transfer_failures: KV transfers that failed or timed out.
        kv_transfer_retries: KV transfers retried.
        kv_transfer_requests: NIXL READ/WRITE operations a worker posted, not client
            requests (per P -> D KV transfer, staged or direct: one per layer, times the TP
            ranks with per-rank agents); the name is kept for compatibility.
        preemptions: sequences preempted (KV blocks freed, to be recomputed).
        cancelled_requests: requests cancelled (client disconnect or abort).
        migrated_requests: requests migrated off a dead or drained D worker.
        request_retries: requests restarted on another instance (labels: the pool and
            instance that failed) after a worker died, hung or reported a retryable error.
        worker_failures: worker processes found dead (exited, or silent past the
            heartbeat timeout), by pool and instance.
        worker_restarts: worker processes restarted by the launcher.
        prompt_tokens: prompt tokens prefilled (cached ones included), counted when each
            prompt's prefill ends, with its ``epd_prefill_seconds`` sample (vLLM's
            ``prompt_tokens_total``); over ``epd_prefill_seconds_count``, the mean ISL.
        prefix_cache_queries_tokens: prompt tokens looked up in the prefix cache.
        prefix_cache_hits_tokens: of those, tokens whose KV was reused, with a third label
            ``tier``: where the block was found (``device``: still in the KV cache;
            ``host``: loaded back from the host tier, ``--kv-host-cache-gb``; ``disk``:
            read back from the disk tier under it, ``--kv-disk-cache-dir``; ``remote``: read
            over NIXL from another prefill instance's KV cache).
        remote_prefix_reads: a prefill instance's remote prefix reads, with a third label
            ``outcome`` (ok: the blocks were read and cached; fallback: the read failed,
            timed out, its holder died or no longer held them, and the prompt was prefilled;
            aborted: the request ended first).
        remote_prefix_read_bytes: KV bytes those reads moved.
        spec_decode_num_drafts: speculative decoding (``--speculative-config``):
            verifications of drafts (vLLM's names, as the next two).
        spec_decode_num_draft_tokens: draft tokens proposed.
        spec_decode_num_accepted_tokens: of those, tokens accepted; the acceptance rate is
            accepted / draft tokens, the mean accepted length 1 + accepted / drafts.
        spec_decode_num_accepted_tokens_per_pos: accepted drafts by their position in the
            draft (third label ``position``, 0-based).
        kv_host_offloaded_blocks: evicted prefix-cache blocks copied to the host tier.
        kv_host_loaded_blocks: host-tier blocks copied back for a prefix hit.
        kv_host_evicted_blocks: host-tier blocks dropped (least recently used) for newer
            ones: a hit rate that stays low while this grows is the tier's capacity.
        kv_disk_stored_blocks: blocks the host tier evicted that were written to disk.
        kv_disk_loaded_blocks: disk-tier blocks read back for a prefix hit.
        kv_disk_evicted_blocks: disk-tier blocks dropped (least recently used) for newer ones.
        kv_disk_write_errors: disk-tier writes that failed (the block became a miss).
        encoder_cache_queries: multimodal items looked up in the encoder (embedding) cache.
        encoder_cache_hits: of those, items whose embedding was reused.
        encode_video_chunks: chunks of temporal patches of a long video an encode worker
            was sent (the router splits one across encoders, ``--video-encode-split``);
            each is also one encoder cache query.
        routing_decisions: requests the router sent to an instance, with a third
            label ``policy`` (the pool's routing policy: kv, free-kv, media-affinity,
            least-loaded, round-robin; ``video-split``: an encoder sent a chunk of a long
            video besides the policy's pick); ``epd_routing_decisions_total``.
        transfers_unterminated: requests whose released NIXL transfers were still in
            flight ``--kv-timeout`` after their release (their blocks or buffer stay
            fenced until they terminate or their peer is gone).
        auth_denied: CURVE handshakes this process's ZAP handler refused: a client key
            that is not the other side's (a member key at a worker's command socket,
            the router key or a stranger's at the router's inbox); ``pool="router"``
            for the router's inbox. ZeroMQ retries a refused handshake, so one
            persistent client counts many times.

    Gauges (``livemax``: the value of the instance's live processes, see below):
        kv_cache_usage_ratio: used / total KV blocks of the instance, 0..1.
        queue_depth: requests waiting in the instance's queue.
        running_requests: requests in the instance's running batch.
        queued_prompt_tokens: prompt tokens still to prefill on the instance (the
            prefill pool's autoscaling signal).
        kv_fenced_blocks: a decode instance's KV blocks held by aborted reservations
            whose writer may still write (not done, not gone).
        kv_host_cache_usage_ratio: used / total blocks of the instance's host tier, 0..1.
        kv_disk_cache_usage_ratio: used / total blocks of the instance's disk tier, 0..1.
        kv_pinned_blocks: a prefill instance's KV blocks pinned for other instances'
            remote prefix reads.
        pool_instances: instances per pool as the router sees them, label ``state``
            (live: routable; draining; dead: registered, not alive, not forgotten yet), labels
            ``pool`` and ``state`` only; ``epd_pool_instances``.
        router_requests: requests open in the router, with a third label ``state``
            (encode, prefill, transfer, decode: ``epd.router.request.RequestState``),
            ``pool="router"``, ``instance="router"``; ``epd_router_requests``. Mode
            ``livesum`` (not ``livemax``: router processes' counts add up).

    Why ``livemax`` for every gauge: each (pool, instance) series is owned by one
    instance, and the TP ranks of an instance run replicated schedulers, so they
    report the same value; ``livesum`` would count it ``tp`` times, ``liveall`` adds
    a ``pid`` label that dashboards must then fold away, and max of identical
    values is that value whether rank 0 alone or every rank reports. ``live``:
    a dead process's gauge file is dropped by :func:`mark_process_dead`, so a crashed
    worker stops reporting stale queue depths and a restarted one (same instance
    id, new pid) is not maxed against its predecessor's last value. Pool totals are
    PromQL's job (``sum by (pool)``).
    """

    time_to_first_token: object
    time_per_output_token: object
    inter_token_latency: object
    e2e_request_latency: object
    encode_queue: object
    encode: object
    embedding_transfer: object
    prefill_queue: object
    prefill: object
    kv_transfer: object
    decode_queue: object
    decode_step: object
    tts_queue: object
    tts_first_audio: object
    tts_synthesis: object
    kv_transfer_bytes: object
    kv_transfer_saved_bytes: object
    kv_transfer_failures: object
    kv_transfer_retries: object
    kv_transfer_requests: object
    transfers_unterminated: object
    tts_phrases: object
    tts_characters: object
    tts_audio_seconds: object
    preemptions: object
    cancelled_requests: object
    migrated_requests: object
    request_retries: object
    worker_failures: object
    worker_restarts: object
    prompt_tokens: object
    prefix_cache_queries_tokens: object
    prefix_cache_hits_tokens: object
    remote_prefix_reads: object
    remote_prefix_read_bytes: object
    spec_decode_num_drafts: object
    spec_decode_num_draft_tokens: object
    spec_decode_num_accepted_tokens: object
    spec_decode_num_accepted_tokens_per_pos: object
    kv_host_offloaded_blocks: object
    kv_host_loaded_blocks: object
    kv_host_evicted_blocks: object
    kv_disk_stored_blocks: object
    kv_disk_loaded_blocks: object
    kv_disk_evicted_blocks: object
    kv_disk_write_errors: object
    encoder_cache_queries: object
    encoder_cache_hits: object
    encode_video_chunks: object
    auth_denied: object
    routing_decisions: object
    kv_cache_usage_ratio: object
    queue_depth: object
    running_requests: object
    router_requests: object
    queued_prompt_tokens: object
    kv_fenced_blocks: object
    kv_host_cache_usage_ratio: object
    kv_disk_cache_usage_ratio: object
    kv_pinned_blocks: object
    pool_instances: object


# field -> (metric name, help, buckets)
_HISTOGRAMS = {
    "time_to_first_token": (TTFT,
                            "Time to first token: request arrival to first output token, seconds", LATENCY_BUCKETS),
    "time_per_output_token": (TPOT,
                              "Time per output token of a request, (t_last - t_first) / (n_out - 1), seconds",
                              STEP_BUCKETS),
    "inter_token_latency": (ITL,
                            "Gap between consecutive output tokens of a request, seconds", STEP_BUCKETS),
    "e2e_request_latency": (E2E,
                            "Request arrival to last token, seconds", LATENCY_BUCKETS),
    "encode_queue": (ENCODE_QUEUE, "Wait in an encode worker's queue, seconds", LATENCY_BUCKETS),
    "encode": (ENCODE, "Encoder forward of one encode request, seconds", LATENCY_BUCKETS),
    "embedding_transfer": (EMBEDDING_TRANSFER,
                           "Embedding transfer E -> P of one request, seconds", TRANSFER_BUCKETS),
    "prefill_queue": (PREFILL_QUEUE, "Wait in a prefill worker's queue, seconds", LATENCY_BUCKETS),
    "prefill": (PREFILL, "Prefill compute of one request, seconds", LATENCY_BUCKETS),
    "kv_transfer": (KV_TRANSFER, "KV cache transfer P -> D of one request, seconds",
                    TRANSFER_BUCKETS),
    "decode_queue": (DECODE_QUEUE,
                     "KV ready on a decode worker to joining its running batch, seconds", LATENCY_BUCKETS),
    "decode_step": (DECODE_STEP, "One decode engine step, seconds", STEP_BUCKETS),
    "tts_queue": (TTS_QUEUE, "Wait of a phrase in a TTS worker's queue, seconds", LATENCY_BUCKETS),
    "tts_first_audio": (TTS_FIRST_AUDIO,
                        "A phrase received by a TTS worker to its first audio chunk, seconds", LATENCY_BUCKETS),
    "tts_synthesis": (TTS_SYNTHESIS, "Synthesis of one phrase, seconds", LATENCY_BUCKETS),
}
# field -> (metric name without _total, help); exposed as <name>_total
_COUNTERS = {
    "kv_transfer_bytes": (_family(KV_BYTES), "KV cache bytes transferred P -> D"),
    "kv_transfer_saved_bytes": (_family(KV_SAVED_BYTES), "Prompt KV bytes a decode instance did not receive "
                                "P -> D: its prefix cache held those blocks"),
    "kv_transfer_failures": (_family(KV_FAILURES), "KV transfers that failed or timed out"),
    "kv_transfer_retries": (_family(KV_RETRIES), "KV transfers retried"),
    "kv_transfer_requests": (_family(KV_OPS), "NIXL READ/WRITE operations posted, one per layer (and "
                             "TP rank with per-rank agents) of each KV transfer: not client requests"),
    "transfers_unterminated": (_family(TRANSFERS_UNTERMINATED), "Requests whose released NIXL transfers were "
                               "not terminated within --kv-timeout (their memory stays fenced)"),
    "tts_phrases": (_family(TTS_PHRASES), "Phrases spoken by a TTS worker"),
    "tts_characters": (_family(TTS_CHARACTERS), "Characters of the phrases a TTS worker spoke"),
    "tts_audio_seconds": (_family(TTS_AUDIO_SECONDS), "Seconds of audio a TTS worker synthesized"),
    "preemptions": (_family(PREEMPTIONS), "Sequences preempted"),
    "cancelled_requests": (_family(CANCELLED), "Requests cancelled"),
    "migrated_requests": (_family(MIGRATED), "Requests migrated to another decode worker"),
    "request_retries": (_family(REQUEST_RETRIES),
                        "Requests restarted on another instance after a worker of this pool died, hung or failed"),
    "worker_failures": (_family(WORKER_FAILURES), "Worker processes of this pool found dead or unresponsive"),
    "worker_restarts": (_family(WORKER_RESTARTS), "Worker processes of this pool restarted by the launcher"),
    "prompt_tokens": (_family(PROMPT_TOKENS), "Prompt tokens prefilled, cached ones included (counted as each "
                      "prefill ends)"),
    "prefix_cache_queries_tokens": (_family(PREFIX_QUERIES), "Prompt tokens looked up in the prefix cache"),
    "kv_host_offloaded_blocks": (_family(KV_HOST_OFFLOADED), "Evicted prefix-cache blocks copied to the host tier"),
    "kv_host_loaded_blocks": (_family(KV_HOST_LOADED), "Host-tier blocks copied back for a prefix hit"),
    "kv_host_evicted_blocks": (_family(KV_HOST_EVICTED), "Host-tier blocks dropped for newer ones (tier full)"),
    "kv_disk_stored_blocks": (_family(KV_DISK_STORED), "Host-tier evictions written to the disk tier"),
    "kv_disk_loaded_blocks": (_family(KV_DISK_LOADED), "Disk-tier blocks read back for a prefix hit"),
    "kv_disk_evicted_blocks": (_family(KV_DISK_EVICTED), "Disk-tier blocks dropped for newer ones (tier full)"),
    "kv_disk_write_errors": (_family(KV_DISK_WRITE_ERRORS), "Disk-tier writes that failed (the block became a "
                             "miss)"),
    "remote_prefix_read_bytes": (_family(REMOTE_PREFIX_READ_BYTES), "KV bytes read from other prefill instances' "
                                 "KV caches (remote prefix reads)"),
    "spec_decode_num_drafts": (_family(SPEC_DRAFTS), "Speculative decoding: verifications of draft tokens"),
    "spec_decode_num_draft_tokens": (_family(SPEC_DRAFT_TOKENS), "Speculative decoding: draft tokens proposed"),
    "spec_decode_num_accepted_tokens": (_family(SPEC_ACCEPTED), "Speculative decoding: draft tokens accepted"),
    "encoder_cache_queries": (_family(ENCODER_QUERIES), "Multimodal items looked up in the encoder cache"),
    "encoder_cache_hits": (_family(ENCODER_HITS), "Multimodal items found in the encoder cache"),
    "encode_video_chunks": (_family(ENCODE_VIDEO_CHUNKS), "Chunks of temporal patches of a video an encode worker was "
                            "sent (a video split across encoders)"),
    "auth_denied": (_family(AUTH_DENIED), "CURVE handshakes refused: a client key that is not the other side's "
                    "(only the router's key may command a worker; only the member key may report to the router)"),
}
# counters with a label beyond pool and instance: field -> (metric name, help, extra labels)
_LABELLED_COUNTERS = {
    "prefix_cache_hits_tokens": (_family(PREFIX_HITS), "Prompt tokens found in the prefix cache, by tier "
                                 "(device, host, disk, remote)", ("tier",)),
    "remote_prefix_reads": (_family(REMOTE_PREFIX_READS), "Remote prefix reads of a prefill instance, by outcome "
                            "(ok, fallback, aborted)", ("outcome",)),
    "routing_decisions": (_family(ROUTED), "Requests routed to an instance, by policy", ("policy",)),
    "spec_decode_num_accepted_tokens_per_pos": (_family(SPEC_ACCEPTED_POS), "Speculative decoding: draft tokens "
                                                "accepted, by position in the draft", ("position",)),
}
# field -> (metric name, help, multiprocess_mode); see Metrics for the choice of mode
_GAUGES = {
    "kv_cache_usage_ratio": (KV_USAGE, "Used / total KV cache blocks, 0..1", "livemax"),
    "queue_depth": (QUEUE_DEPTH, "Requests waiting in the queue", "livemax"),
    "running_requests": (RUNNING, "Requests in the running batch", "livemax"),
    "queued_prompt_tokens": (QUEUED_PROMPT_TOKENS, "Prompt tokens waiting to be prefilled (queued or "
                             "partly prefilled requests)", "livemax"),
    "kv_fenced_blocks": (KV_FENCED_BLOCKS, "KV blocks of aborted reservations whose writer may still write",
                         "livemax"),
    "kv_pinned_blocks": (KV_PINNED_BLOCKS, "KV blocks pinned for other instances' remote prefix reads",
                         "livemax"),
    "kv_disk_cache_usage_ratio": (KV_DISK_USAGE, "Used / total blocks of the prefix cache's disk tier, 0..1",
                                  "livemax"),
    "kv_host_cache_usage_ratio": (KV_HOST_USAGE, "Used / total blocks of the prefix cache's host tier, 0..1",
                                  "livemax"),
}

_lock = threading.Lock()
_metrics: Metrics | None = None
_metrics_dir: str | None = None  # $PROMETHEUS_MULTIPROC_DIR when _metrics was built
_registry = None  # own CollectorRegistry (single-process mode); never the global REGISTRY
_owned_dirs: list[str] = []


def multiprocess_dir() -> str | None:
    """``$PROMETHEUS_MULTIPROC_DIR`` if set (multiprocess mode), else None."""
    return os.environ.get(ENV) or None


def _sync_value_class(new_dir: bool = False) -> None:
    """prometheus_client picks its value class (mmap files or in-memory) when
    ``prometheus_client.values`` is first imported; if it was imported before the
    environment variable was set, switch it now (before any metric object exists).
    ``new_dir``: the directory changed, so drop the class that caches open files."""
    from prometheus_client import values

    wants_mp = multiprocess_dir() is not None
    is_mp = getattr(values.ValueClass, "_multiprocess", False)
    if wants_mp and (not is_mp or new_dir):
        values.ValueClass = values.get_value_class()
    elif not wants_mp and is_mp:
        values.ValueClass = values.MutexValue


def setup_multiprocess_dir(path: str | os.PathLike | None = None) -> str:
    """Create a fresh metrics directory and export it as ``$PROMETHEUS_MULTIPROC_DIR``.

    Call once in the launcher, before any worker starts and before :func:`get_metrics`.
    ``path=None`` makes a temporary directory (removed when this process exits); an
    existing ``path`` has its ``*.db`` files from an earlier run deleted so that old
    counters are not summed into the new ones.

    Returns:
        the directory's absolute path.

    Raises:
        RuntimeError: metric objects already exist in this process (call this first).
    """
    if _metrics is not None:
        raise RuntimeError(
            "epd.metrics.setup_multiprocess_dir() must be called before get_metrics() in this process "
            f"(metrics already write to {_metrics_dir or 'memory'})")
    if path is None:
        d = tempfile.mkdtemp(prefix="epd-metrics-")
        _owned_dirs.append(d)
        if len(_owned_dirs) == 1:
            atexit.register(_remove_owned_dirs)
    else:
        d = os.path.abspath(os.fspath(path))
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            if name.endswith(".db"):
                os.remove(os.path.join(d, name))
    with _lock:
        changed = os.environ.get(ENV) != d
        os.environ[ENV] = d
        _sync_value_class(new_dir=changed)
    return d


def _remove_owned_dirs() -> None:
    for d in _owned_dirs:
        shutil.rmtree(d, ignore_errors=True)


def get_metrics() -> Metrics:
    """This process's metric objects, created on the first call (after the launcher has
    set ``$PROMETHEUS_MULTIPROC_DIR``, which children inherit)."""
    global _metrics, _metrics_dir, _registry
    if _metrics is not None:
        return _metrics
    with _lock:
        if _metrics is not None:
            return _metrics
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        _sync_value_class()
        _registry = CollectorRegistry(auto_describe=True)
        objs: dict[str, object] = {}
        for field, (name, doc, buckets) in _HISTOGRAMS.items():
            objs[field] = Histogram(name, doc, LABELS, buckets=buckets, registry=_registry)
        for field, (name, doc) in _COUNTERS.items():
            objs[field] = Counter(name, doc, LABELS, registry=_registry)
        for field, (name, doc, extra) in _LABELLED_COUNTERS.items():
            objs[field] = Counter(name, doc, (*LABELS, *extra), registry=_registry)
        for field, (name, doc, mode) in _GAUGES.items():
            objs[field] = Gauge(name, doc, LABELS, multiprocess_mode=mode, registry=_registry)
        objs["router_requests"] = Gauge(ROUTER_REQUESTS, "Requests open in the router, by state",
                                        (*LABELS, "state"), multiprocess_mode="livesum", registry=_registry)
        objs["pool_instances"] = Gauge(POOL_INSTANCES, "Instances per pool seen by the router, by state",
                                       ("pool", "state"), multiprocess_mode="livemax", registry=_registry)
        _metrics_dir = multiprocess_dir()
        _metrics = Metrics(**objs)
        return _metrics


def mark_process_dead(pid: int) -> None:
    """Drop the live-gauge files of a dead process (no-op outside multiprocess mode).
    The launcher calls it for every worker it reaps."""
    d = multiprocess_dir()
    if d is None or not os.path.isdir(d):
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, d)


def render_latest() -> tuple[bytes, str]:
    """Prometheus text exposition of every process's metrics, and its content type.

    In multiprocess mode a fresh ``CollectorRegistry`` with a ``MultiProcessCollector``
    merges all files of ``$PROMETHEUS_MULTIPROC_DIR`` (counters and histograms summed,
    gauges by their mode). Without the variable it renders this process's metrics.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    d = multiprocess_dir()
    if d is not None:
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=d)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    get_metrics()
    return generate_latest(_registry), CONTENT_TYPE_LATEST


def _reset_for_tests() -> None:
    """Forget this process's metric objects (tests that switch directories)."""
    global _metrics, _metrics_dir, _registry
    with _lock:
        _metrics = _metrics_dir = _registry = None
        _sync_value_class(new_dir=True)
