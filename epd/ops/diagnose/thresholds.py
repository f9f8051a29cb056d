"""The thresholds of ``epd diagnose``'s checks and its defaults (seconds unless said otherwise)."""

#: observations of a per-request histogram (TTFT, TPOT, e2e, prefill queue/exec, KV transfer,
#: decode queue) in the window before a check judges it: with fewer, a p99 is one request's luck
MIN_REQUESTS = 10
#: observations of a per-token or per-step histogram (ITL, decode step) before a check judges it
MIN_STEPS = 50
#: a spike: an ITL gap (or a decode step) at least this many times the median ...
SPIKE_RATIO = 3.0
#: ... and at least this long: a stall shorter than 50 ms is invisible to whoever reads the stream
SPIKE_MIN_S = 0.05
#: share (0..1) of the streams' time between tokens (the ITL sum) spent in spikes from which
#: they stall visibly; a time share, not a p99: one long prefill a second stalls every stream
#: for long, yet is a small fraction of the gaps when the streams are fast
SPIKE_TIME_SHARE = 0.1
#: ... and at least this many of them (gaps; for decode steps: steps), so one hiccup is not a pattern
SPIKE_MIN_COUNT = 5
#: prefill queue mean at least this many times the prefill execution mean: waiting, not
#: computing, makes the prefill stage's time
QUEUE_DOMINANCE_RATIO = 2.0
#: ... and at least this long: a queue of a few ms dominating a fast prefill is no problem
PREFILL_QUEUE_MIN_S = 0.2
#: ... and at least this share of the TTFT mean: the queue is what the client waits for
QUEUE_SHARE_OF_TTFT = 0.5
#: requests in prefill execution at once per prefill instance, mean over the window (Little's
#: law: prefill execution seconds / window / instances), under which a queueing prefill pool is
#: under-used: prompts are prefilled one at a time (each step's token budget holds one prompt's
#: chunk) instead of several per step
PREFILL_CONCURRENCY_MIN = 1.5
#: KV transfer p99 at least this long ...
KV_TRANSFER_P99_S = 0.25
#: ... and at least this many times the prefill execution p99: the transfer starts with the
#: first layer's write and overlaps the compute of the later layers, so only a transfer that
#: outlasts the compute is the wire's fault
KV_TRANSFER_OVER_PREFILL = 1.5
#: KV cache usage (used / total blocks, 0..1) counted as full
KV_USAGE_HIGH = 0.9
#: preemptions in the window of one pool that count as "many": at least this many ...
PREEMPTIONS_MIN = 2
#: ... and at least this fraction of the requests routed to the pool in the window
PREEMPTION_FRACTION = 0.05
#: decode queue p95 at least this long: requests whose KV arrived wait for a batch slot
DECODE_QUEUE_HIGH_S = 0.5
#: mean requests waiting per decode instance, with the cache full, that count as KV-bound
DECODE_WAITING_MIN = 1.0
#: prompt tokens looked up in a pool's prefix cache in the window before its hit rate is judged
PREFIX_MIN_QUERY_TOKENS = 2048
#: prefix-cache hit rate (hit tokens / looked-up tokens, 0..1) below which the cache is missed
PREFIX_HIT_RATE_MIN = 0.10
#: goodput / throughput (upper bound, 0..1) below which goodput is "far below" throughput:
#: fewer than half of the requests can have met both SLOs
GOODPUT_MIN_FRACTION = 0.5
#: busy fraction (instance-seconds of work / instances / window, 0..1) under which a pool idles
POOL_IDLE_MAX = 0.25
#: seconds between the gauge samples (an idle worker publishes its gauges at least every 2 s,
#: a busy one every 0.25 s)
DEFAULT_INTERVAL_S = 1.0
#: a suspected block leak is read again after this long before it is reported (longer than the
#: 2 s an idle worker may take to publish its gauges)
LEAK_CONFIRM_S = 3.0
#: SLOs of the goodput check (epd bench's defaults), seconds
DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.1
