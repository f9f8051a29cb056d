"""Router <-> worker control messages (ZeroMQ) and their codec, ``encode`` / ``decode``.

Each message is a tagged msgspec struct sent as msgpack, never pickle; ``decode`` also
reads the prefill -> decode NIXL notifications (``epd.messages.kv_notifs``). The
in-process types go on the wire as they are (``SamplingParams``, and ``Placeholder`` /
``MediaItem`` from ``epd.multimodal``); a ``torch.Tensor`` field travels as a
``TensorBlob`` (``epd.messages.tensors``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from epd.messages.base import MessageError, Region, Shutdown
from epd.messages.kv_layout import KVLayout
from epd.messages.kv_notifs import KVReady, KVWriterDone, KVWriterFenced, PrefixPin, PrefixPinned, PrefixUnpin
from epd.messages.tensors import dec_hook, enc_hook
from epd.multimodal import MediaItem, Placeholder
from epd.sampling_params import SamplingParams


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
    #: longest prompt + output its engine serves, after its KV cache lowered it (0: no engine, not said)
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: seconds its main loop may go without an iteration before it counts as wedged (0: not judged)
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: blocks its prefix cache's host and disk tiers hold beyond ``kv_layout.num_blocks`` (0: none)
    num_tier_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Any worker -> router: alive, and its load (sequences, KV blocks).

    ``seq``: the load report's number in its process (1, 2, ... in the order the
    worker loop made them; the heartbeat thread repeats the latest under its
    number; 0: not numbered). The router keeps the highest-numbered report, and
    a decode worker's report numbered above the last one the router had when a
    ``KVReserved`` arrived includes that reservation (``epd.router.policies``).

    ``loop``: iterations of the worker's main loop so far (every beat carries the
    current count, also the thread's repeats): a count that stops advancing for the
    worker's ``WorkerReady.stall_timeout_s`` means a wedged loop (0: not counted).
    ``incarnation``: its ``WorkerReady.incarnation``; a beat of another process under
    the same instance id (a replacement the router has not accepted yet) refreshes
    nothing (0: not said).
    """

    instance_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    seq: int = 0
    loop: Annotated[int, msgspec.Meta(ge=0)] = 0
    incarnation: int = 0


class KVEvents(msgspec.Struct, tag="kv_events", frozen=True):
    """P/PD -> router, at most once per heartbeat: net prefix-cache changes since the last report.

    ``stored`` / ``removed``: 16-byte block hashes (``iter_block_hashes``) that
    entered the KV cache / left the instance (removed = evicted from every tier,
    or reset); ``stored_host`` / ``stored_disk``: hashes now held only in the
    host / disk tier (``--kv-host-cache-gb``, ``--kv-disk-cache-dir``: evicted
    from the KV cache, loadable on a hit); ``cleared``: the cache was reset
    before them. Each hash appears in one list, with its last change. The
    router applies cleared, removed, then the rest. ``pid`` ties the report to
    the process of the instance's ``WorkerReady``. Used only to choose where
    requests run.
    """

    instance_id: str
    pid: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False
    stored_host: list[bytes] = []
    stored_disk: list[bytes] = []


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
    ``generation``: the span's random nonzero id, also written as an int64 word in the
    encoder's buffer after the data (``epd.workers.embedding_buffer``); the reader reads
    the word back after the data and uses the data only if it still holds this id.
    """

    item_hash: str
    region: Region
    shape: list[int]
    dtype: str
    instance_id: str = ""
    temporal_range: TemporalRange | None = None
    generation: int = 0


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
    notifications that carry it (see docs/architecture.md, "KV connector").
    ``num_cached_blocks``: leading blocks of the prompt the decode instance already
    holds in its prefix cache (decode-side reuse); ``block_ids`` are the blocks after
    them, the only ones the prefill worker writes."""

    request_id: str
    instance_id: str
    block_ids: list[int]
    staging_block: int = -1
    generation: int = 0
    num_cached_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0


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
    # KVReserved.num_cached_blocks: decode_block_ids take the prompt's blocks from this one on
    decode_num_cached_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    # another prefill instance whose KV cache holds more of the prompt's prefix, per the
    # router's KV index: read those blocks from it over NIXL first ("": none)
    prefix_holder: str = ""
    prefix_holder_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # leading blocks it holds, per that index


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
           | WorkerStats | Shutdown | Registered | RegistrationRefused | RouterPing | Draining | PrefixPin
           | PrefixPinned | PrefixUnpin)


_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, dec_hook=dec_hook)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises MessageError for anything that is not one well-formed message."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MessageError(f"malformed control message: {e}") from None


class _Named(msgspec.Struct):
    """Only the ``request_id`` of a message; every other field is skipped unchecked."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]


_named_decoder = msgspec.msgpack.Decoder(_Named)


def request_id_of(data: bytes) -> str | None:
    """The ``request_id`` that the bytes of a message ``decode`` refused name (read
    leniently, so a command too large or malformed to handle can still be answered with
    ``RequestFailed``); None when they name none."""
    try:
        return _named_decoder.decode(data).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
