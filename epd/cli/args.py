"""Argument groups that several ``epd`` subcommands share: the engine's settings
(``generate``), routing, failure recovery and the OpenAI API (``launch``, ``serve``), and
the help of the KV flags (``launch``, ``worker``). Defaults come from
:class:`~epd.launch.config.LaunchConfig`, so ``--help`` shows them."""

from __future__ import annotations

import argparse

from epd.cli.validators import non_negative_float, positive_float, positive_int
from epd.launch.config import (
    DTYPE_NAMES,
    KV_CACHE_DTYPE_NAMES,
    KV_FAILURE_POLICIES,
    QUANTIZATION_NAMES,
    ROUTING_POLICIES,
    TOOL_CALL_PARSERS,
    VIDEO_ENCODE_SPLITS,
    LaunchConfig,
)
from epd.roles import Role

KV_CACHE_DTYPE_HELP = ("KV cache: auto (the model's dtype), or quantized, int8 or fp8_e4m3 (fp8): 1 byte a value "
                        "plus 4 bytes per 16 values of each token and KV head (int8: a float16 scale and min, and a "
                        "full block's K per channel, KIVI-style; fp8: a float32 scale): 3.2x the fp32 blocks per GB "
                        "at head_dim 64; prefill and decode workers must use the same (the router refuses a mismatch)")

QUANTIZATION_HELP = ("weight-only quantization of every linear layer and the LM head: int8, one float32 scale per "
                     "output channel (vLLM's --quantization flag, W8A16; llama.cpp's q8_0 with one block a row); "
                     "halves the weight bytes a decode step reads against bf16 (default: none, the --dtype weights)")


KV_AGENTS_HELP = ("NIXL agents of a tensor-parallel prefill/decode instance: rank0 (one agent, rank 0's, moves a "
                   "staging pool every rank maps) or per-rank (every rank owns an agent, its KV and its own staging "
                   "buffer and writes its own KV heads, as vLLM's NixlConnector); prefill and decode must use the "
                   "same (default: %(default)s)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's settings of an in-process ``epd.LLM`` (``epd generate``)."""
    p.add_argument("--model", default=None,
                   help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="model and KV cache dtype (default: auto: bfloat16 where the device computes it natively)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--quantization", choices=QUANTIZATION_NAMES, default=None, help=QUANTIZATION_HELP)
    p.add_argument("--device", default="auto")


def add_routing_args(rt, d: LaunchConfig) -> None:
    """The router's policy per pool (``--encode-routing`` ...), into group ``rt``; defaults from ``d``."""
    rt.add_argument("--encode-routing", choices=ROUTING_POLICIES[Role.ENCODE], default=d.encode_routing,
                    help="encode pool: media-affinity sends a repeated image/clip to the encoder that cached it "
                         "(rendezvous hashing on the item hash; least-loaded when that one is overloaded) "
                         "(default: %(default)s)")
    rt.add_argument("--prefill-routing", choices=ROUTING_POLICIES[Role.PREFILL], default=d.prefill_routing,
                    help="prefill and pd pools: kv picks the lowest overlap-weight x blocks still to prefill + open "
                         "blocks, from the block hashes each instance's prefix cache reports (default: %(default)s)")
    rt.add_argument("--decode-routing", choices=ROUTING_POLICIES[Role.DECODE], default=d.decode_routing,
                    help="decode pool: free-kv picks the most free KV blocks after reservations, then the smallest "
                         "running batch (default: %(default)s)")
    rt.add_argument("--video-encode-split", choices=VIDEO_ENCODE_SPLITS, default=d.video_encode_split,
                    help="auto: with 2+ live encoders, a Qwen-VL video of 2+ temporal patches is encoded in "
                         "contiguous chunks of temporal patches, one per encoder (exact: the tower attends within "
                         "a patch); off: a request's items all go to one encoder (default: %(default)s)")
    rt.add_argument("--kv-overlap-weight", type=non_negative_float, default=d.kv_overlap_weight,
                    help="weight of the blocks still to prefill against the open blocks in the kv policy's cost "
                         "(default: %(default)s; 0 ignores cached prefixes)")
    rt.add_argument("--no-remote-prefix-reads", dest="remote_prefix_reads", action="store_false",
                    help="a prefill instance prefills the prefix blocks another prefill instance's KV cache holds, "
                         "instead of reading them from it over NIXL (default: read them, when both run TP 1 and "
                         "the other holds at least 4 more blocks)")


def add_recovery_args(fr, d: LaunchConfig, launcher: bool = True) -> None:
    """Retries and timeouts, into group ``fr``; with ``launcher`` also the workers' transfer
    timeout and restarts (``epd launch`` starts the workers)."""
    fr.add_argument("--max-retries", type=int, default=d.max_retries,
                    help="further attempts of a request on other instances after a worker dies, hangs or fails a "
                         "transfer; a decode worker lost mid-stream migrates its requests (default: %(default)s; "
                         "0 disables)")
    fr.add_argument("--kv-failure-policy", choices=list(KV_FAILURE_POLICIES), default=d.kv_failure_policy,
                    help="a failed or timed-out P->D KV transfer is retried through prefill (retry) or the decode "
                         "worker prefills the prompt itself (recompute) (default: %(default)s)")
    fr.add_argument("--stage-timeout", type=float, default=d.stage_timeout,
                    help="seconds a request may wait for one stage (encode, KV reservation, prefill) "
                         "(default: %(default)s)")
    fr.add_argument("--token-timeout", type=float, default=d.token_timeout,
                    help="seconds a request may wait between two tokens (default: %(default)s)")
    fr.add_argument("--forget-dead-after", type=non_negative_float, default=d.forget_dead_after,
                    help="seconds after a worker is found dead (and its peers were told, at least 8 s after its "
                         "last heartbeat unless its process was seen to exit) that the router forgets it: its "
                         "socket closes, and a pool whose members are all forgotten is gone (default: %(default)s)")
    if not launcher:
        return
    fr.add_argument("--stall-timeout", type=non_negative_float, default=d.stall_timeout,
                    help="seconds a worker's main loop may spend in one iteration (its longest step) before the "
                         "router counts it dead and its /live answers 503 (default: the worker's, 60; 0: never)")
    fr.add_argument("--kv-timeout", type=float, default=d.kv_timeout,
                    help="seconds a worker waits for one NIXL transfer before failing it (default: the worker's, 30)")
    fr.add_argument("--embedding-ttl", type=float, default=d.embedding_ttl,
                    help="seconds an encode worker keeps a request's embeddings after the router ended the request, "
                         "before reclaiming them (default: the worker's, 1)")
    fr.add_argument("--max-worker-restarts", type=int, default=d.max_worker_restarts,
                    help="times the launcher restarts each crashed worker instance (default: %(default)s; "
                         "0: never)")


def add_api_args(api, d: LaunchConfig) -> None:
    """The HTTP front end's key, limits and names, into group ``api``; defaults from ``d``."""
    api.add_argument("--api-key", default=d.api_key,
                     help="require 'Authorization: Bearer KEY' on /v1 requests (default: $EPD_API_KEY, else none)")
    api.add_argument("--require-api-key", action="store_true", default=d.require_api_key,
                     help="refuse to start without an API key (--api-key or a non-empty $EPD_API_KEY), so the API "
                          "is never open by mistake (the Kubernetes manifests set it)")
    api.add_argument("--max-body-mb", type=float, default=d.max_body_mb,
                     help="largest request body in MiB; larger ones get 413 (default: %(default)s)")
    api.add_argument("--max-inflight-body-mb", type=positive_float, default=d.max_inflight_body_mb,
                     help="request bodies being read at once, all requests together, in MiB (a body's "
                          "Content-Length is taken before it is read); more get 503 with Retry-After; at least "
                          "--max-body-mb (default: %(default)s)")
    api.add_argument("--max-pending-requests", type=positive_int, default=d.max_pending_requests,
                     help="requests in flight at once; more get 429 (default: %(default)s)")
    api.add_argument("--max-n", type=positive_int, default=d.max_n,
                     help="largest n (choices per request) (default: %(default)s)")
    api.add_argument("--allowed-media-domains", default=d.allowed_media_domains,
                     help="comma-separated hosts whose http(s) image URLs are fetched (subdomains included); "
                          "addresses that resolve to private, loopback or link-local ranges are refused anyway "
                          "(default: none, only data: URLs)")
    api.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout,
                     help="seconds one media URL fetch may take, redirects included (default: %(default)s)")
    api.add_argument("--max-media-mb", type=float, default=d.max_media_mb,
                     help="largest fetched media body in MiB (default: %(default)s)")
    api.add_argument("--video-fps", type=positive_float, default=d.video_fps,
                     help="frames sampled per second of a video_url's video; a request's "
                          "media_io_kwargs.video.fps overrides it (default: %(default)s)")
    api.add_argument("--max-video-frames", type=positive_int, default=d.max_video_frames,
                     help="most frames sampled from one video (longer videos are sampled more sparsely, uniformly "
                          "over their duration); a request's media_io_kwargs.video.num_frames may ask for fewer "
                          "(default: %(default)s)")
    api.add_argument("--max-video-seconds", type=positive_float, default=d.max_video_seconds,
                     help="longest video accepted, from its header and again while decoding; longer ones get "
                          "400 (default: %(default)s)")
    api.add_argument("--max-mm-item-mb", type=positive_float, default=d.max_mm_item_mb,
                     help="largest processed tensor of one media item, in MiB, computed from the media's header "
                          "before processing: a larger image is scaled down to fit, a video sampled with fewer "
                          "frames; one a request pins (media_io_kwargs.video.num_frames) gets 400; at most 256, "
                          "what a worker accepts (default: %(default)s)")
    api.add_argument("--max-realtime-sessions", type=positive_int, default=d.max_realtime_sessions,
                     help="/v1/realtime sessions open at once; more are closed with code 1013 (default: %(default)s)")
    api.add_argument("--realtime-idle-timeout", type=non_negative_float, default=d.realtime_idle_timeout,
                     metavar="SECONDS",
                     help="close a /v1/realtime session that sends no event for this long while none of its "
                          "responses or transcriptions runs (an error event, code session_idle_timeout, then "
                          "close code 1000), freeing its slot; 0: never (default: %(default)s)")
    api.add_argument("--allowed-origins", default=d.allowed_origins,
                     help="comma-separated browser origins (scheme://host[:port], or *) allowed to open /v1/realtime; "
                          "other Origin headers get 403, clients sending none pass (default: none)")
    api.add_argument("--served-model-name", nargs="+", default=d.served_model_name, metavar="NAME",
                     help="the model names the API answers to (requests naming another get 404); the first is "
                          "the one it reports, in /v1/models and every response (default: the --model path, or "
                          "SmolLM2-135M-Instruct)")
    api.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=d.tool_call_parser,
                     help="the format the model writes tool calls in: hermes <tool_call>{...}</tool_call> "
                          "(Qwen2.5/3, SmolLM3, Hermes), llama3_json, mistral [TOOL_CALLS] "
                          "(default: detected from the chat template, else hermes)")
