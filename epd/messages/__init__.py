"""Every message between epd processes: one module per channel.

Each message is a tagged msgspec struct sent as msgpack, never pickle:

- ``control``: router <-> worker over ZeroMQ, and its codec ``encode`` / ``decode``;
- ``kv_notifs``: NIXL notifications, prefill -> decode and prefill <-> prefill (same codec);
- ``tp``: rank 0 -> the other TP ranks of an instance (the KV connector's messages);
- ``kv_layout``: a worker's advertised KV memory; ``tensors``: ``TensorBlob``;
  ``base``: ``Region``, ``MessageError``, ``Shutdown`` (router -> worker and rank 0 -> ranks).

The in-process types go on the wire as they are (``SamplingParams``, and
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
  P -> P (NIXL notifs, remote prefix read): PrefixPin, PrefixPinned, PrefixUnpin
  rank 0 -> ranks 1..: StepInput (epd.engine.step_input), KVRankMessage, Shutdown
"""

from epd.messages.base import (
    MessageError,
    Region,
    Shutdown,
)
from epd.messages.control import (
    MAX_AUDIO_CHUNK_BYTES,
    MAX_TTS_TEXT_CHARS,
    ROUTER_PING_S,
    ROUTER_TIMEOUT_S,
    Abort,
    AudioChunk,
    Draining,
    EmbeddingRef,
    EncodeDone,
    EncodeRequest,
    GenerateRequest,
    Heartbeat,
    KVEvents,
    KVReserved,
    Message,
    PeerGone,
    PeerInfo,
    PrefillDone,
    PrefillRequest,
    Registered,
    RegistrationRefused,
    ReleaseEmbeddings,
    RequestFailed,
    ReserveKV,
    RouterPing,
    StatsRequest,
    SynthesizeRequest,
    TemporalRange,
    TokenLogprob,
    TokenOutput,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
    request_id_of,
)
from epd.messages.kv_layout import (
    KVLayout,
    RankKV,
)
from epd.messages.kv_notifs import (
    KVReady,
    KVWriterDone,
    KVWriterFenced,
    PrefixPin,
    PrefixPinned,
    PrefixUnpin,
)
from epd.messages.tensors import (
    MAX_TENSOR_BYTES,
    TensorBlob,
    typed_view,
)
from epd.messages.tp import (
    KVPlan,
    KVPoll,
    KVRankMessage,
    KVRelease,
    KVUnpack,
    RankPeer,
    RankPeers,
    RankSend,
    RankTarget,
)

__all__ = [
    "Region", "MessageError", "Shutdown", "MAX_TENSOR_BYTES", "TensorBlob", "typed_view", "RankKV",
    "KVLayout", "KVReady", "KVWriterDone", "KVWriterFenced", "PrefixPin", "PrefixPinned", "PrefixUnpin",
    "TokenLogprob", "WorkerReady", "Heartbeat",
    "KVEvents", "PeerInfo", "TemporalRange", "EncodeRequest", "EmbeddingRef", "EncodeDone", "ReserveKV",
    "KVReserved", "PrefillRequest", "PrefillDone", "GenerateRequest", "TokenOutput", "MAX_TTS_TEXT_CHARS",
    "MAX_AUDIO_CHUNK_BYTES", "SynthesizeRequest", "AudioChunk", "RequestFailed", "Abort", "PeerGone",
    "ReleaseEmbeddings", "StatsRequest", "WorkerStats", "Registered", "RegistrationRefused", "ROUTER_PING_S",
    "ROUTER_TIMEOUT_S", "RouterPing", "Draining", "Message", "encode", "decode", "request_id_of", "KVUnpack",
    "RankTarget", "RankSend", "KVPlan", "KVPoll", "KVRelease", "RankPeer", "RankPeers", "KVRankMessage",
]
