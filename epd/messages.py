"""Every control-plane message between epd processes, in one module.

ZeroMQ carries these as msgpack (msgspec) — never pickle. Each message is a
tagged struct; ``encode`` / ``decode`` are the only (de)serialisers. The
in-process types go on the wire as they are (``SamplingParams``, and
``Placeholder`` / ``MediaItem`` from ``epd.multimodal``). A ``torch.Tensor``
field travels as a ``TensorBlob`` (dtype name, shape, raw bytes; the
encoder's ``enc_hook`` / decoder's ``dec_hook``), checked on decode against an
allow-list of dtypes, the byte count implied by the shape and
``MAX_TENSOR_BYTES``.
Bulk data (embeddings, KV cache) never rides here: it moves over NIXL, and
these messages carry only descriptor tables (``Region`` = addr, nbytes,
device id) that the receiver validates against what the peer advertised.

Flow (see docs/architecture.md, "Wire messages"):
  router -> E: EncodeRequest            E -> router: EncodeDone
  router -> D: ReserveKV (prompt, params, placeholders) D -> router: KVReserved
  router -> P: PrefillRequest           P -> router: PrefillDone ; P -> D (NIXL notif): KVReady or KVWriterDone
  router -> PD: GenerateRequest (aggregated pool)
  router -> T: SynthesizeRequest (one phrase) T -> router: AudioChunk (stream, the last one ``final``)
  D/PD -> router: TokenOutput (stream)  any -> router: WorkerReady, Heartbeat, RequestFailed
  P/PD -> router: KVEvents (prefix-cache changes, for KV-aware routing)
  router -> any: Abort, PeerGone, Shutdown, Registered / RegistrationRefused, RouterPing
  any -> router: Draining (SIGTERM)     P -> D (NIXL notif, router lost): KVWriterFenced
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
import numpy as np
import torch

from epd.multimodal import MediaItem, Placeholder
from epd.sampling_params import SamplingParams

Region = tuple[int, int, int]  # (addr, nbytes, device_id) of registered memory

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
#: a KVLayout's ``dtype``: a float dtype, or a quantized cache's kind (uint8 rows, epd.kernels.kv_quant)
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "int8": torch.uint8, "fp8_e4m3": torch.uint8}
MAX_TENSOR_BYTES = 256 * 2**20


class MessageError(ValueError):
    """A message failed to decode or validate (the sender is buggy or hostile)."""


class TensorBlob(msgspec.Struct, frozen=True):
    """A tensor on the wire: ``dtype`` name, ``shape``, raw little-endian bytes.

    Every ``torch.Tensor`` field of a message (``MediaItem.data``) is sent as one
    (``_enc_hook``) and checked by ``to_tensor`` on decode (``_dec_hook``); engine
    workers check embeddings read over NIXL the same way."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TensorBlob:
        t = t.detach().contiguous().cpu()
        if t.dtype not in _DTYPE_NAMES:
            raise MessageError(f"dtype {t.dtype} cannot be sent")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(_DTYPE_NAMES[t.dtype], list(t.shape), raw)

    def to_tensor(self) -> torch.Tensor:
        """Raises MessageError when dtype, shape and byte count disagree."""
        buf = np.frombuffer(self.data, dtype=np.uint8).copy()
        return typed_view(torch.from_numpy(buf), self.dtype, self.shape)


def typed_view(raw: torch.Tensor, dtype: str, shape: list[int]) -> torch.Tensor:
    """``raw`` (uint8 ``[nbytes]``, on any device) viewed as a ``dtype`` tensor of ``shape``,
    after checking the header another process sent (``TensorBlob``'s dtype names).

    Raises:
        MessageError: an unknown dtype, a negative dimension, or a byte count that does
            not match (or exceeds ``MAX_TENSOR_BYTES``).
    """
    torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MessageError(f"bad tensor header: dtype={dtype!r} shape={shape}")
    expected = math.prod(shape) * torch.tensor([], dtype=torch_dtype).element_size()
    if expected != raw.numel() or expected > MAX_TENSOR_BYTES:
        raise MessageError(f"tensor of shape {shape} ({dtype}) needs {expected} bytes, "
                           f"got {raw.numel()} (limit {MAX_TENSOR_BYTES})")
    return raw.view(torch_dtype).reshape(shape)



class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability and its top alternatives (``epd.outputs.TokenLogprobs``)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]

    @classmethod
    def from_output(cls, lp) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs))


# ---- worker lifecycle -------------------------------------------------------
class RankKV(msgspec.Struct, frozen=True):
    """One TP rank's own NIXL agent and the memory it exposes (``--kv-agents per-rank``).

    ``agent``: the agent's name (rank 0: the instance id; rank r: ``<instance>.tp<r>``);
    ``nixl_metadata``: its ``get_agent_metadata`` bytes (b"" for rank 0, whose metadata is
    the instance's own ``WorkerReady.nixl_metadata``); ``k_regions[l]`` / ``v_regions[l]``:
    layer l of this rank's paged cache; ``staging_regions[l]``: layer l of this rank's
    private staging buffer (its own KV heads only; [] when it has none).
    """

    agent: str
    nixl_metadata: bytes
    k_regions: list[Region]
    v_regions: list[Region]
    staging_regions: list[Region] = []


class KVLayout(msgspec.Struct, frozen=True):
    """How a worker's paged KV cache lies in memory (per TP rank).

    k and v caches: [num_layers, num_blocks, block_size, num_kv_heads, head_dim];
    ``k_regions[l]`` / ``v_regions[l]`` cover layer l's [num_blocks, ...] slab.
    ``tp``: the instance's TP ranks (``num_kv_heads`` is per rank). A worker with a
    staging pool (heterogeneous TP, ``epd.transfer.staging``) advertises it:
    ``staging_regions[l]`` covers layer l of the pool, ``staging_block_bytes`` is one
    staging block (K and V of every KV head) of one layer. With ``kv_agents`` "per-rank"
    ``ranks[r]`` is rank r's agent and regions (rank 0's equal the fields above).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    k_regions: list[Region]
    v_regions: list[Region]
    tp: int = 1
    staging_regions: list[Region] = []
    staging_block_bytes: int = 0
    #: "rank0": one agent (rank 0's) and a staging pool shared by every rank; "per-rank":
    #: every rank owns an agent (``ranks``), its own KV regions and its own staging buffer,
    #: whose block then holds this rank's heads only (``staging_block_bytes`` / tp).
    kv_agents: str = "rank0"
    ranks: list[RankKV] = []

    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=_KV_DTYPES[self.dtype]).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem


class WorkerReady(msgspec.Struct, tag="ready", frozen=True):
    role: str  # an epd.roles.Role value
    instance_id: str
    pid: int
    cmd_endpoint: str  # where the worker's command socket is bound
    nixl_metadata: bytes
    regions: list[Region]  # memory peers may read/write (KV cache, embedding buffer)
    kv_layout: KVLayout | None = None
    startup_s: float = 0.0
    incarnation: int = 0  # random per process: a repeat of this WorkerReady is the same member re-joining
    model: str = ""  # epd.models.checkpoints.model_fingerprint of the checkpoint it serves ("": not said)


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Any worker -> router: alive, and its load (sequences, KV blocks).

    ``seq``: the load report's number in its process (1, 2, ... in the order the
    worker loop made them; the heartbeat thread repeats the latest under its
    number; 0: not numbered). The router keeps the highest-numbered report, and
    a decode worker's report numbered above the last one the router had when a
    ``KVReserved`` arrived includes that reservation (``epd.router.policies``).
    """

    instance_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    seq: int = 0


class KVEvents(msgspec.Struct, tag="kv_events", frozen=True):
    """P/PD -> router, at most once per heartbeat: net prefix-cache changes since the last report.

    ``stored`` / ``removed``: 16-byte block hashes (``iter_block_hashes``) that
    entered / left the prefix cache (removed = evicted or reset); ``cleared``:
    the cache was reset before them. The router applies cleared, removed,
    stored in that order. ``pid`` ties the report to the process of the
    instance's ``WorkerReady``. Used only to choose where requests run.
    """

    instance_id: str
    pid: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False


class PeerInfo(msgspec.Struct, tag="peer", frozen=True):
    """Router -> worker: a peer's NIXL metadata and the regions it exposes."""

    instance_id: str
    nixl_metadata: bytes
    regions: list[Region]
    kv_layout: KVLayout | None = None
    pid: int = 0  # the peer's process (its incarnation)


# ---- encode -------------------------------------------------------------------
#: a video chunk: temporal patches [start, end) of a Qwen2-VL / Qwen2.5-VL video item
TemporalRange = tuple[int, int]


class EncodeRequest(msgspec.Struct, tag="encode", frozen=True):
    """Router -> E: encode ``items``.

    ``temporal_ranges``: empty (every item whole), or one entry per item: None (the item
    whole) or ``(start, end)``, a chunk of a video item: only its temporal patches
    ``start..end-1`` are encoded (grid ``(end - start, h, w)``); the item then carries just
    their pixel rows (``pixel_values_videos`` [(end - start) * h * w, ...]) beside the whole
    video's ``video_grid_thw`` and ``num_tokens``. The encoder checks the range against them.
    """

    request_id: str
    items: list[MediaItem]
    temporal_ranges: list[TemporalRange | None] = []


class EmbeddingRef(msgspec.Struct, frozen=True):
    """Where an item's embedding [num_tokens, hidden] (or a chunk's rows of it) lies in an
    E worker's buffer.

    ``instance_id``: the encode instance whose buffer holds it ("": the message's
    ``encode_instance``); the prefill side reads each instance's refs in one NIXL read.
    ``temporal_range``: the video chunk these rows are (``EncodeRequest.temporal_ranges``);
    None: the whole item. The chunks of one item follow each other in temporal order,
    the first starting at 0, and are concatenated into the item's placeholder.
    """

    item_hash: str
    region: Region
    shape: list[int]
    dtype: str
    instance_id: str = ""
    temporal_range: TemporalRange | None = None


class EncodeDone(msgspec.Struct, tag="encode_done", frozen=True):
    request_id: str
    instance_id: str
    embeddings: list[EmbeddingRef] = []
    transcripts: list[str] = []
    encode_s: float = 0.0
    queue_s: float = 0.0


# ---- prefill / decode -----------------------------------------------------------
class ReserveKV(msgspec.Struct, tag="reserve", frozen=True):
    """Router -> D: reserve blocks for the prompt's KV, and remember the request.

    ``placeholders``: the prompt's media spans (as in ``PrefillRequest``); their item
    hashes enter the decode side's block hashes, so after a preemption the sequence
    can only hit its own media KV in the prefix cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    placeholders: list[Placeholder] = []
    kv_writer: str = ""  # the prefill instance that will write the KV: only its notifications count


class KVReserved(msgspec.Struct, tag="reserved", frozen=True):
    """D -> router. ``staging_block``: first block of the staging range reserved for
    the prompt's KV (-1: none; the prefill worker writes block to block).
    ``generation``: a random 63-bit id of this reservation, echoed by the prefill
    worker in ``KVReady`` / ``KVWriterDone``; the decode worker acts only on
    notifications that carry it (see docs/architecture.md, "KV connector")."""

    request_id: str
    instance_id: str
    block_ids: list[int]
    staging_block: int = -1
    generation: int = 0


class PrefillRequest(msgspec.Struct, tag="prefill", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_instance: str
    decode_block_ids: list[int]
    placeholders: list[Placeholder] = []
    encode_instance: str | None = None
    embeddings: list[EmbeddingRef] = []
    decode_staging_block: int = -1  # KVReserved.staging_block
    decode_generation: int = 0  # KVReserved.generation


class KVReady(msgspec.Struct, tag="kv_ready", frozen=True):
    """P -> D NIXL notification: all KV of the request is in D's blocks (or, when
    staged, in D's staging range, laid out by ``src_tp`` prefill ranks)."""

    request_id: str
    first_token: int
    src_tp: int = 1
    generation: int = 0  # KVReserved.generation


class KVWriterDone(msgspec.Struct, tag="kv_writer_done", frozen=True):
    """P -> D NIXL notification: this prefill worker will never write the reservation's
    blocks (its send was aborted or failed, and every write of it has ended), sent
    instead of ``KVReady``. ``generation``: ``KVReserved.generation``."""

    request_id: str
    generation: int


class KVWriterFenced(msgspec.Struct, tag="kv_writer_fenced", frozen=True):
    """P -> D NIXL notification, sent when the prefill worker lost its router: every send
    it had is dropped and none of its earlier instructions will ever write again, so
    the reservations that named it as writer before now are free on the decode side."""


class PrefillDone(msgspec.Struct, tag="prefill_done", frozen=True):
    request_id: str
    instance_id: str
    first_token: int
    num_cached_tokens: int
    kv_bytes: int
    kv_transfer_s: float
    prefill_s: float
    queue_s: float
    num_transfer_requests: int
    kv_exposed_s: float = 0.0  # transfer time left after the prefill forward ended (not hidden by compute)
    kv_write_s: float = 0.0  # time inside NIXL write calls during the forward (synchronous copies on CPU)
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    """Router -> PD worker (aggregated): the whole request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    placeholders: list[Placeholder] = []
    encode_instance: str | None = None
    embeddings: list[EmbeddingRef] = []


class TokenOutput(msgspec.Struct, tag="tokens", frozen=True):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []  # one per token id, when the request asked for logprobs


# ---- text-to-speech -----------------------------------------------------------------
#: characters of one phrase to synthesize, and PCM bytes in one audio chunk (~1.4 s at 24 kHz)
MAX_TTS_TEXT_CHARS = 4096
MAX_AUDIO_CHUNK_BYTES = 64 * 2**10


class SynthesizeRequest(msgspec.Struct, tag="synthesize", frozen=True):
    """Router -> T: speak ``text`` (one phrase of an answer) in ``voice``."""

    request_id: str
    text: Annotated[str, msgspec.Meta(max_length=MAX_TTS_TEXT_CHARS)]
    voice: Annotated[str, msgspec.Meta(max_length=64)]


class AudioChunk(msgspec.Struct, tag="audio_chunk", frozen=True):
    """T -> router: the next PCM16 little-endian mono samples of a phrase, at
    ``sample_rate`` Hz; ``final``: the phrase is complete (``pcm`` may be empty);
    ``synth_s``: seconds the synthesizer spent on the phrase so far."""

    request_id: str
    instance_id: str
    pcm: Annotated[bytes, msgspec.Meta(max_length=MAX_AUDIO_CHUNK_BYTES)]
    sample_rate: Annotated[int, msgspec.Meta(ge=8000, le=48000)] = 24000
    final: bool = False
    synth_s: float = 0.0


class RequestFailed(msgspec.Struct, tag="failed", frozen=True):
    """Worker -> router: a request failed here. ``retryable``: another instance
    (or a second try) may succeed; ``kind`` = "kv_transfer" when the P -> D KV
    transfer failed or timed out (the router then retries or recomputes by policy).
    ``status``: who failed, as HTTP (``epd.errors.error_status``): 400 the request,
    503 capacity, 500 epd itself."""

    request_id: str
    instance_id: str
    error: str
    retryable: bool = False
    kind: str = ""
    status: int = 500


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Router -> worker: stop the request. To a decode worker holding a reservation,
    ``kv_writer`` / ``kv_writer_pid`` name the prefill worker (instance, process) that
    was told to write into it and has not reported back ("": none): the blocks stay
    fenced until that writer sends ``KVWriterDone`` or its process is gone."""

    request_id: str
    kv_writer: str = ""
    kv_writer_pid: int = 0


class PeerGone(msgspec.Struct, tag="peer_gone", frozen=True):
    """Router -> workers: the process ``pid`` of ``instance_id`` exited (the launcher saw it)."""

    instance_id: str
    pid: int


class ReleaseEmbeddings(msgspec.Struct, tag="release", frozen=True):
    """P/PD -> E (NIXL notification after reading): the request's embeddings may go."""

    request_id: str


class StatsRequest(msgspec.Struct, tag="stats_request", frozen=True):
    token: int


class WorkerStats(msgspec.Struct, tag="stats", frozen=True):
    """A worker's answer to ``StatsRequest``: counters and sizes (numbers) and a few names
    (strings, e.g. ``kv_cache_dtype``)."""

    instance_id: str
    token: int
    stats: dict[str, float | str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


# ---- membership -------------------------------------------------------------------------
class Registered(msgspec.Struct, tag="registered", frozen=True):
    """Router -> worker: its ``WorkerReady`` was accepted by the router of ``epoch`` (a
    random id of that router process); the worker is a member until it loses that router."""

    instance_id: str
    epoch: int


class RegistrationRefused(msgspec.Struct, tag="refused", frozen=True):
    """Router -> worker: its ``WorkerReady`` was refused (``reason``). ``permanent``: it can
    never join (another model than the router's), so it exits 1; otherwise (a live process
    holds the instance id) it asks again."""

    instance_id: str
    reason: str
    permanent: bool = False


#: seconds between two RouterPing to every worker
ROUTER_PING_S = 0.5
#: a worker that reads no RouterPing for this long treats its router as lost and drops everything
ROUTER_TIMEOUT_S = 5.0


class RouterPing(msgspec.Struct, tag="router_ping", frozen=True):
    """Router -> every registered worker, every ``ROUTER_PING_S``: the router of ``epoch`` is
    alive. A worker that reads none for ``ROUTER_TIMEOUT_S`` treats the router as lost."""

    epoch: int


class Draining(msgspec.Struct, tag="draining", frozen=True):
    """Worker -> router on SIGTERM: route nothing new here; the process ``pid`` finishes or
    hands off what it has (the router migrates a draining decode worker's streams) and exits."""

    instance_id: str
    pid: int


Message = (WorkerReady | Heartbeat | KVEvents | PeerInfo | EncodeRequest | EncodeDone | ReserveKV | KVReserved
           | PrefillRequest | KVReady | PrefillDone | GenerateRequest | TokenOutput | SynthesizeRequest | AudioChunk
           | RequestFailed | Abort | PeerGone | KVWriterDone | KVWriterFenced | ReleaseEmbeddings | StatsRequest
           | WorkerStats | Shutdown | Registered | RegistrationRefused | RouterPing | Draining)


def _enc_hook(obj):
    """``torch.Tensor`` -> ``TensorBlob`` (``MessageError`` for a dtype off the allow-list)."""
    if isinstance(obj, torch.Tensor):
        return TensorBlob.from_tensor(obj)
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


def _dec_hook(tp, obj):
    """A ``TensorBlob`` map -> ``torch.Tensor``, checked by ``TensorBlob.to_tensor``; any
    error becomes a ``msgspec.ValidationError`` (so ``MessageError`` from ``decode``)."""
    if tp is torch.Tensor:
        if not isinstance(obj, dict) or not isinstance(obj.get("data"), bytes):  # convert() would take base64 text
            raise MessageError("a tensor must be a TensorBlob map with raw bytes")
        blob = msgspec.convert(obj, TensorBlob)
        try:
            return blob.to_tensor()
        except MessageError:
            raise
        except Exception as e:  # e.g. torch refusing a view: still a bad message, never a crash
            raise MessageError(f"bad tensor {blob.dtype} {blob.shape}: {e}") from None
    raise TypeError(f"{tp} cannot be received")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, dec_hook=_dec_hook)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises MessageError for anything that is not one well-formed message."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MessageError(f"malformed control message: {e}") from None
