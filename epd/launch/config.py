"""The settings of ``epd launch`` and ``epd serve``: one typed, validated config built once from the CLI.

:class:`LaunchConfig`'s field defaults are the single source of the launch
defaults: ``epd launch``'s argparse options take theirs from it (so ``--help``
shows them), and :func:`epd.launch.api_process.serve` reads the config, never the raw
``argparse.Namespace``. Kept free of torch so that ``epd --help`` stays fast.
(:mod:`epd.launch` says which other settings type is for what.)

``__post_init__`` checks the fields, raising :class:`~epd.launch.spec.LaunchSpecError`
that names the field: a config built in code (or from a hand-made Namespace) is refused
where the flags' argparse types (:mod:`epd.cli.validators`, :func:`int_list`) would
refuse the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from epd.launch.spec import LaunchSpecError, parse_pools, parse_tp
from epd.roles import Role
from epd.tts import check_engine as check_tts_engine

__all__ = ["LaunchConfig", "ROUTING_POLICIES", "KV_FAILURE_POLICIES", "WORKER_ENGINE_FLAGS", "DTYPE_NAMES",
           "KV_CACHE_DTYPE_NAMES", "QUANTIZATION_NAMES", "KV_AGENTS", "TOOL_CALL_PARSERS", "VIDEO_ENCODE_SPLITS",
           "int_list"]

#: routing policies per pool, the default first (epd.router.policies.POLICIES, kept here so
#: `epd --help` need not import torch; tests check that the two agree)
ROUTING_POLICIES = {Role.ENCODE: ("media-affinity", "least-loaded", "round-robin"),
                    Role.PREFILL: ("kv", "least-loaded", "round-robin"),
                    Role.DECODE: ("free-kv", "least-loaded", "round-robin")}

#: what a failed P->D KV transfer does (applied by epd.router.recovery), the default first
KV_FAILURE_POLICIES = ("retry", "recompute")
#: --video-encode-split: "auto" splits a long Qwen-VL video over the encode pool, "off" never
#: (epd.router.encode_split)
VIDEO_ENCODE_SPLITS = ("auto", "off")

#: ``--tool-call-parser`` values (epd.api.tool_parsers.PARSERS, kept here so `epd --help` need
#: not import the API; tests check that the two agree)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

#: ``--dtype`` values (epd.config.EngineConfig.dtype)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
#: ``--kv-cache-dtype``: the model's dtype, or a quantized cache (``fp8`` = ``fp8_e4m3``, as vLLM)
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8_e4m3", "fp8")
#: ``--quantization``: weight-only quantization of the linear layers (epd.config.EngineConfig.quantization;
#: not given: the model's dtype)
QUANTIZATION_NAMES = ("int8",)
#: ``--kv-agents``: NIXL agents of a TP instance (epd.transfer.rank_agent)
KV_AGENTS = ("rank0", "per-rank")


def int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)`` (``--cuda-graph-sizes``).

    Raises:
        argparse.ArgumentTypeError: not a comma-separated list of integers >= 1.
    """
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, e.g. 1,2,4,8; got {text!r}")
    return sizes


#: engine settings a worker takes (flag, type; bool: a switch); `epd launch` forwards the
#: ones given to every worker
WORKER_ENGINE_FLAGS = (("--block-size", int), ("--max-num-seqs", int), ("--max-num-batched-tokens", int),
                       ("--max-prefill-tokens-with-decodes", int), ("--target-step-ms", float),
                       ("--kv-cache-memory-gb", float), ("--kv-host-cache-gb", float),
                       ("--kv-disk-cache-dir", str), ("--kv-disk-cache-gb", float),
                       ("--num-kv-blocks", int), ("--max-model-len", int), ("--dtype", str),
                       ("--kv-cache-dtype", str), ("--quantization", str),
                       ("--compile", bool), ("--enforce-eager", bool), ("--no-decode-kv-reuse", bool),
                       ("--cuda-graph-sizes", int_list), ("--speculative-config", str),
                       ("--tts-engine", str))


#: ``epd.messages.MAX_TENSOR_BYTES`` in MiB, the largest tensor a worker decodes (written out here:
#: the messages pull in torch, which ``epd worker`` imports only once it can be stopped cleanly)
WIRE_TENSOR_MB = 256.0


@dataclass(slots=True, frozen=True)
class LaunchConfig:
    """Everything ``epd launch`` was asked for; one field per ``epd launch`` flag
    (``--router-port`` -> ``router_port``). Fields are documented by the flags' help
    (``epd launch --help``).

    Raises:
        LaunchSpecError: an invalid ``pools`` / ``tp`` spec (the message of
            :func:`epd.launch.spec.parse_pools` / :func:`~epd.launch.spec.parse_tp`), or
            a value outside what the matching flag accepts.
    """

    # pools and placement
    pools: str = "e:1,p:1,d:1"
    tp: str | None = None
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    threads_per_worker: int | None = None  # None: the thread budget (epd.workers.thread_budget)
    router_port: int = 0  # 0: pick a free one
    router_host: str = "127.0.0.1"  # the router's ZeroMQ bind address (`epd serve`; `epd launch` keeps loopback)
    cluster_keys: str | None = None  # CURVE keys dir (None: $EPD_CLUSTER_KEYS; `epd launch`: fresh ones)
    ready_timeout: float = 600.0
    # engine settings forwarded to every worker (None: the worker's default)
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_tokens_with_decodes: int | None = None
    target_step_ms: float | None = None
    kv_cache_memory_gb: float | None = None
    kv_host_cache_gb: float | None = None
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_gb: float | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None  # one of QUANTIZATION_NAMES (None: the model's dtype)
    compile: bool | None = None
    enforce_eager: bool | None = None
    no_decode_kv_reuse: bool | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None
    speculative_config: str | None = None  # vLLM's JSON (epd.engine.spec_decode.SpeculativeConfig)
    tts_engine: str | None = None  # the tts pool's synthesizer (epd.tts.load_synthesizer; None: espeak)
    # routing
    encode_routing: str = ROUTING_POLICIES[Role.ENCODE][0]
    prefill_routing: str = ROUTING_POLICIES[Role.PREFILL][0]
    decode_routing: str = ROUTING_POLICIES[Role.DECODE][0]
    kv_overlap_weight: float = 1.0
    remote_prefix_reads: bool = True  # --no-remote-prefix-reads turns them off
    video_encode_split: str = "auto"  # one of VIDEO_ENCODE_SPLITS
    # failure recovery
    max_retries: int = 2
    kv_failure_policy: str = KV_FAILURE_POLICIES[0]
    stage_timeout: float = 120.0
    token_timeout: float = 120.0
    kv_timeout: float | None = None  # None: the worker's default
    embedding_ttl: float | None = None  # None: the worker's default
    stall_timeout: float | None = None  # a worker's main loop without an iteration this long: wedged (None: 60)
    forget_dead_after: float = 60.0  # seconds after which the router forgets a dead worker
    max_worker_restarts: int = 5
    # OpenAI API
    api_key: str | None = None  # None: $EPD_API_KEY, else none
    require_api_key: bool = False  # refuse to start without an API key (flag or $EPD_API_KEY)
    max_body_mb: float = 64.0
    max_inflight_body_mb: float = 256.0  # bytes of request bodies being read at once (503 past it)
    max_pending_requests: int = 256
    max_n: int = 8
    allowed_media_domains: str = ""  # comma-separated
    media_fetch_timeout: float = 10.0
    max_media_mb: float = 20.0
    video_fps: float = 2.0  # frames sampled per second of video (a request's media_io_kwargs.video.fps wins)
    max_video_frames: int = 32  # frames sampled from one video at most
    max_video_seconds: float = 600.0  # longest video accepted (declared duration)
    max_mm_item_mb: float = WIRE_TENSOR_MB  # one media item's processed tensors; at most WIRE_TENSOR_MB
    max_realtime_sessions: int = 64
    realtime_idle_timeout: float = 600.0  # seconds without a client event that close a realtime session; 0: never
    allowed_origins: str = ""  # comma-separated; none: browsers (which send Origin) are refused on /v1/realtime
    tool_call_parser: str | None = None  # None: detected from the chat template
    served_model_name: list[str] | None = None  # the names clients may ask for; the first is reported
    # KV staging when prefill or decode is tensor-parallel
    kv_staging_mb: int = 256
    kv_agents: str = "rank0"  # one of KV_AGENTS (epd.transfer.rank_agent)

    def __post_init__(self) -> None:
        tp = parse_tp(self.tp, parse_pools(self.pools))
        if self.kv_host_cache_gb and any(size > 1 for size in tp.values()):
            raise LaunchSpecError(f"--kv-host-cache-gb (the prefix cache's host tier) needs TP 1 in every pool (the "
                                  f"tier copies one rank's KV), got --tp {self.tp}")
        for role, field_name in ((Role.ENCODE, "encode_routing"), (Role.PREFILL, "prefill_routing"),
                                 (Role.DECODE, "decode_routing")):
            if getattr(self, field_name) not in ROUTING_POLICIES[role]:
                raise LaunchSpecError(f"{field_name} must be one of {ROUTING_POLICIES[role]}, "
                                      f"got {getattr(self, field_name)!r}")
        if self.video_encode_split not in VIDEO_ENCODE_SPLITS:
            raise LaunchSpecError(f"video_encode_split must be one of {VIDEO_ENCODE_SPLITS}, "
                                  f"got {self.video_encode_split!r}")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise LaunchSpecError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, "
                                  f"got {self.kv_failure_policy!r}")
        if self.max_prefill_tokens_with_decodes is not None and self.max_prefill_tokens_with_decodes < 0:
            raise LaunchSpecError(f"max_prefill_tokens_with_decodes must be >= 0 (0: off), "
                                  f"got {self.max_prefill_tokens_with_decodes}")
        if self.target_step_ms is not None and not self.target_step_ms >= 0:
            raise LaunchSpecError(f"target_step_ms must be >= 0 (0: off), got {self.target_step_ms}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise LaunchSpecError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise LaunchSpecError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise LaunchSpecError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_NAMES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise LaunchSpecError(f"quantization must be one of {QUANTIZATION_NAMES} (or not given: the model's "
                                  f"dtype), got {self.quantization!r}")
        if self.tts_engine is not None:
            try:
                check_tts_engine(self.tts_engine)
            except ValueError as e:
                raise LaunchSpecError(f"tts_engine: {e}") from None
        if self.kv_agents not in KV_AGENTS:
            raise LaunchSpecError(f"kv_agents must be one of {KV_AGENTS}, got {self.kv_agents!r}")
        if not self.forget_dead_after >= 0 or (self.stall_timeout is not None and not self.stall_timeout >= 0):
            raise LaunchSpecError(f"forget_dead_after and stall_timeout must be >= 0, got {self.forget_dead_after}, "
                                  f"{self.stall_timeout}")
        if not self.kv_overlap_weight >= 0:  # also rejects nan
            raise LaunchSpecError(f"kv_overlap_weight must be >= 0, got {self.kv_overlap_weight}")
        if not self.realtime_idle_timeout >= 0:  # also rejects nan
            raise LaunchSpecError(f"realtime_idle_timeout must be >= 0 (0: never), got {self.realtime_idle_timeout}")
        if not (self.video_fps > 0 and self.max_video_seconds > 0):  # also rejects nan
            raise LaunchSpecError(f"video_fps and max_video_seconds must be > 0, got {self.video_fps}, "
                                  f"{self.max_video_seconds}")
        if self.kv_host_cache_gb is not None and not 0 <= self.kv_host_cache_gb < float("inf"):  # also nan
            raise LaunchSpecError(f"kv_host_cache_gb must be a finite number >= 0 (GiB of host memory per worker "
                                  f"for evicted prefix-cache blocks; 0: none), got {self.kv_host_cache_gb}")
        if self.kv_disk_cache_dir is not None or self.kv_disk_cache_gb is not None:
            gb = self.kv_disk_cache_gb
            if not (self.kv_disk_cache_dir and gb is not None and 0 < gb < float("inf") and self.kv_host_cache_gb):
                raise LaunchSpecError("the prefix cache's disk tier needs --kv-disk-cache-dir, a finite "
                                      "--kv-disk-cache-gb > 0 and the host tier above it (--kv-host-cache-gb > 0); "
                                      f"got --kv-disk-cache-dir {self.kv_disk_cache_dir}, --kv-disk-cache-gb {gb}, "
                                      f"--kv-host-cache-gb {self.kv_host_cache_gb}")
            if not os.path.isdir(self.kv_disk_cache_dir):
                raise LaunchSpecError(f"--kv-disk-cache-dir {self.kv_disk_cache_dir}: no such directory")
        if self.speculative_config:
            from epd.engine.spec_decode import SpeculativeConfig

            try:
                SpeculativeConfig.parse(self.speculative_config)
            except ValueError as e:
                raise LaunchSpecError(str(e)) from None
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < float("inf"):  # also nan
            raise LaunchSpecError(f"kv_cache_memory_gb must be a finite number > 0 (GiB of KV cache per worker "
                                  f"rank), got {self.kv_cache_memory_gb}")
        if not 0 < self.max_mm_item_mb <= WIRE_TENSOR_MB:  # also rejects nan
            raise LaunchSpecError(f"max_mm_item_mb must be > 0 and at most {WIRE_TENSOR_MB:g} (the largest tensor "
                                  f"a worker accepts), got {self.max_mm_item_mb}")
        if not self.max_inflight_body_mb >= self.max_body_mb > 0:  # also rejects nan
            raise LaunchSpecError(f"max_inflight_body_mb ({self.max_inflight_body_mb}) must be >= max_body_mb "
                                  f"({self.max_body_mb}) > 0: a body of the largest size must fit")
        for name in ("threads_per_worker", "max_pending_requests", "max_n", "kv_staging_mb", "max_realtime_sessions",
                     "max_video_frames", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LaunchSpecError(f"{name} must be >= 1, got {value}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchConfig:
        """The config of parsed ``epd launch`` arguments. Attributes that are not
        fields (``command``, ``func``) are ignored; fields ``args`` lacks keep their
        defaults, so a hand-built Namespace needs only the settings it changes."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def forwarded_worker_args(self) -> list[str]:
        """``epd worker`` flags for the worker settings given: the engine flags of
        :data:`WORKER_ENGINE_FLAGS`, ``--kv-timeout``, ``--embedding-ttl`` and ``--stall-timeout``."""
        out = []
        for flag, typ in WORKER_ENGINE_FLAGS:
            value = getattr(self, flag[2:].replace("-", "_"))
            if typ is bool:
                out += [flag] if value else []
            elif typ is int_list and value is not None:
                out += [flag, ",".join(str(v) for v in value)]
            elif value is not None:
                out += [flag, str(value)]
        if self.kv_timeout is not None:
            out += ["--kv-timeout", str(self.kv_timeout)]
        if self.embedding_ttl is not None:
            out += ["--embedding-ttl", str(self.embedding_ttl)]
        if self.stall_timeout is not None:
            out += ["--stall-timeout", str(self.stall_timeout)]
        return out
