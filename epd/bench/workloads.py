"""Benchmark workloads: the requests a run sends, built deterministically from a seed.

* ``chat``: short prompts (``--input-len`` 32-128 tokens) and ``--output-len`` outputs.
* ``long-mix``: the chat mix plus a steady share (``--long-share``, spread evenly, not
  random) of long prompts (``--long-input-len``), RAG / agent style.
* ``multimodal``: 1-4 images per request (skimage's bundled CC0 photos, resized to at
  most 336 px, JPEG data URLs) and a short question; ``--audio-share`` of the requests
  carry a speech clip (``tests/data/speech``, WAV ``input_audio``) instead.
* ``voice``: a speech clip per request, sent over the Realtime WebSocket as PCM16 24 kHz.
* ``trace``: a replayed JSONL/CSV trace (:mod:`epd.bench.traces`), lengths scaled to the
  server's ``max_model_len``; Mooncake hash ids become shared blocks of text.

Synthetic text is drawn from common English words, each about one token in GPT-style
BPE vocabularies (SmolLM2: 1.0-1.1 tokens per word; pass a tokenizer to calibrate
exactly). ``--system-prompt-len`` adds a system message to every request: the same text
for all (``shared``, prefix-cache hits) or a different one each (``unique``).
``--media-reuse`` is the share of images and speech clips sent byte-identical to the
canonical copy (encoder-cache hits); the others get a few pixels (one audio sample)
changed per request, so their item hashes differ.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epd.bench.traces import TraceRow, block_tokens

WORKLOADS = ("chat", "long-mix", "multimodal", "voice", "trace")

_WORDS = (
    "the of and to in is for that on with as it be at by this from or have an are not was but "
    "all we can one has more will their if which about out up so what its time new some there "
    "when also like only year first just over into other people most two make any after well "
    "back good work way use could see where even then our much need many before three down own "
    "long day both last home world show life day man small still great every part place right "
    "water city same game high state next end old under group area open light book line name "
    "house power money story music team point start case story week form food level side hand "
    "family school order early change report study power plan market office sound voice river "
    "table paper model value field heart space green watch train cloud stone horse bridge "
    "garden window summer winter morning evening coffee letter number street market answer"
).split()
WORDS = tuple(dict.fromkeys(_WORDS))  # de-duplicated, order kept

SPEECH_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "speech"
IMAGE_NAMES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "camera")
VOICE_RATE = 24000


@dataclass(slots=True)
class RequestSpec:
    """One request to send. ``messages``: OpenAI chat messages (content parts for media);
    ``audio_pcm16``: little-endian PCM16 mono at ``VOICE_RATE`` Hz for voice requests;
    ``prompt_tokens``: the intended prompt length (an estimate for synthetic text);
    ``arrival_s``: recorded arrival time (trace replay), else ``None``."""

    kind: str
    messages: list[dict]
    max_tokens: int
    prompt_tokens: int | None = None
    audio_pcm16: bytes | None = None
    arrival_s: float | None = None
    num_images: int = 0


@dataclass(slots=True)
class WorkloadOptions:
    """Knobs of the workloads (token counts are targets for synthetic text)."""

    input_len: tuple[int, int] = (32, 128)
    output_len: int = 64
    long_share: float = 0.2
    long_input_len: tuple[int, int] = (768, 1024)
    images: tuple[int, int] = (1, 4)
    media_reuse: float = 0.0
    audio_share: float = 0.0
    system_prompt_len: int = 0
    system_prompt: str = "shared"  # or "unique"
    trace_path: Path | None = None
    trace_rows: list[TraceRow] = field(default_factory=list)
    trace_block_tokens: int = 0
    speech_dir: Path = SPEECH_DIR

    def __post_init__(self) -> None:
        for name in ("input_len", "long_input_len", "images"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be 0 < low <= high, got {(lo, hi)}")
        if self.images[1] > 4:
            raise ValueError(f"at most 4 images per request, got {self.images[1]}")
        for name in ("long_share", "media_reuse", "audio_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {v}")
        if self.output_len < 1 or self.system_prompt_len < 0:
            raise ValueError("output_len must be >= 1 and system_prompt_len >= 0")
        if self.system_prompt not in ("shared", "unique"):
            raise ValueError(f"system_prompt must be 'shared' or 'unique', got {self.system_prompt!r}")


class TextMaker:
    """Synthetic text of about ``n`` tokens: ``tokens_per_word`` (1.0 by default; see
    :func:`calibrate`) converts token targets into word counts."""

    def __init__(self, tokens_per_word: float = 1.0) -> None:
        if not tokens_per_word > 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word

    def words_for(self, n_tokens: int) -> int:
        return max(1, round(n_tokens / self.tokens_per_word))

    def text(self, n_tokens: int, rng: np.random.Generator) -> str:
        idx = rng.integers(0, len(WORDS), size=self.words_for(n_tokens))
        return " ".join(WORDS[i] for i in idx)

    def block(self, key: int, n_tokens: int, seed: int = 0) -> str:
        """The same text for the same (key, n_tokens, seed): one shared prefix block."""
        return self.text(n_tokens, np.random.default_rng([seed, 7, key]))


def calibrate(tokenizer, sample_words: int = 2000) -> float:
    """Tokens per word of :data:`WORDS` text under ``tokenizer`` (a transformers tokenizer)."""
    text = TextMaker().text(sample_words, np.random.default_rng(0))
    return len(tokenizer.encode(text, add_special_tokens=False, verbose=False)) / sample_words  # no too-long warning


def steady_share(n: int, share: float) -> list[bool]:
    """``n`` flags, round(n * share) of them True, spread evenly (i is True when
    floor((i + 1) * share) > floor(i * share))."""
    return [math.floor((i + 1) * share + 1e-9) > math.floor(i * share + 1e-9) for i in range(n)]


def load_images(max_side: int = 336) -> list:
    """skimage's bundled CC0 photos (:data:`IMAGE_NAMES`) as RGB PIL images whose longer
    side is at most ``max_side`` px."""
    import skimage.data
    from PIL import Image

    out = []
    for name in IMAGE_NAMES:
        img = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        img.thumbnail((max_side, max_side))
        out.append(img)
    return out


def image_data_url(img, variant: int | None = None) -> str:
    """JPEG (quality 90) data URL of ``img``; ``variant`` (not None) first sets a 4x4
    corner patch to a colour derived from it, so every variant has distinct bytes."""
    if variant is not None:
        img = img.copy()
        rgb = ((variant * 97) % 256, (variant * 57 + 101) % 256, (variant * 13 + 199) % 256)
        for x in range(4):
            for y in range(4):
                img.putpixel((x, y), rgb)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def load_speech(speech_dir: Path = SPEECH_DIR, max_s: float = 10.0) -> list[tuple[str, bytes, np.ndarray, int]]:
    """Speech clips no longer than ``max_s``: (name, WAV bytes, float32 mono samples,
    sample rate). Raises FileNotFoundError when the folder has none."""
    import soundfile as sf

    clips = []
    for path in sorted(Path(speech_dir).glob("*.wav")):
        data, rate = sf.read(path, dtype="float32", always_2d=True)
        mono = data.mean(axis=1)
        if len(mono) / rate <= max_s:
            clips.append((path.name, path.read_bytes(), mono, rate))
    if not clips:
        raise FileNotFoundError(f"no speech clips (*.wav, <= {max_s} s) in {speech_dir}")
    return clips


def audio_variant(samples: np.ndarray, rate: int, variant: int | None) -> tuple[bytes, np.ndarray]:
    """(16-bit PCM WAV bytes, float32 samples) of a clip; ``variant`` (not None) first
    shifts the first sample by a variant-dependent 1-1000 PCM16 steps, so every variant
    decodes to a different waveform."""
    import soundfile as sf

    samples = np.array(samples, dtype=np.float32)
    if variant is not None:
        samples[0] = np.clip(samples[0] + (variant % 1000 + 1) / 32768.0, -1.0, 1.0)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, subtype="PCM_16", format="WAV")
    return buf.getvalue(), samples


def pcm16(samples: np.ndarray, rate: int, out_rate: int = VOICE_RATE) -> bytes:
    """Mono float samples in [-1, 1] at ``rate`` Hz -> little-endian PCM16 bytes at
    ``out_rate`` Hz (linear-interpolation resampling)."""
    samples = np.asarray(samples, dtype=np.float64)
    if rate != out_rate and len(samples):
        n = max(1, round(len(samples) * out_rate / rate))
        samples = np.interp(np.arange(n) * (rate / out_rate), np.arange(len(samples)), samples)
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def _system(opts: WorkloadOptions, text: TextMaker, rng: np.random.Generator, seed: int) -> list[dict]:
    if not opts.system_prompt_len:
        return []
    body = (text.block(0, opts.system_prompt_len, seed=0) if opts.system_prompt == "shared"
            else text.text(opts.system_prompt_len, rng))
    return [{"role": "system", "content": body}]


def build_requests(workload: str, n: int, opts: WorkloadOptions, seed: int = 0,
                   text: TextMaker | None = None, max_model_len: int | None = None) -> list[RequestSpec]:
    """``n`` requests of ``workload`` (one of :data:`WORKLOADS`), deterministic for a seed
    (different seeds give different text and image variants, so a rate sweep's runs do
    not hit each other's cache entries). For ``trace``, ``opts.trace_rows`` (already
    scaled) are replayed in order and ``n`` is capped at their number.
    Raises ValueError for an unknown workload or a prompt that cannot fit ``max_model_len``."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    text = text or TextMaker()
    rng = np.random.default_rng([seed, 1])
    specs: list[RequestSpec] = []
    if workload in ("chat", "long-mix"):
        longs = steady_share(n, opts.long_share if workload == "long-mix" else 0.0)
        for is_long in longs:
            lo, hi = opts.long_input_len if is_long else opts.input_len
            k = int(rng.integers(lo, hi + 1))
            msgs = _system(opts, text, rng, seed) + [{"role": "user", "content": text.text(k, rng)}]
            specs.append(RequestSpec("long" if is_long else "chat", msgs, opts.output_len,
                                     k + opts.system_prompt_len))
    elif workload == "multimodal":
        images = load_images()
        clips = load_speech(opts.speech_dir) if opts.audio_share > 0 else []
        audio = steady_share(n, opts.audio_share)
        for i in range(n):
            q = int(rng.integers(8, 25))
            parts: list[dict] = []
            if audio[i]:
                _, _, samples, rate = clips[i % len(clips)]
                reuse = rng.random() < opts.media_reuse
                wav, _ = audio_variant(samples, rate, None if reuse else seed * 1_000_003 + i)
                parts.append({"type": "input_audio",
                              "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}})
                kind, n_img = "audio", 0
            else:
                n_img = int(rng.integers(opts.images[0], opts.images[1] + 1))
                for j in range(n_img):
                    img = images[int(rng.integers(0, len(images)))]
                    reuse = rng.random() < opts.media_reuse
                    variant = None if reuse else (seed * 1_000_003 + i * 4 + j + 1)
                    parts.append({"type": "image_url", "image_url": {"url": image_data_url(img, variant)}})
                kind = "image"
            parts.append({"type": "text", "text": text.text(q, rng)})
            msgs = _system(opts, text, rng, seed) + [{"role": "user", "content": parts}]
            specs.append(RequestSpec(kind, msgs, opts.output_len, q + opts.system_prompt_len, num_images=n_img))
    elif workload == "voice":
        clips = load_speech(opts.speech_dir)
        for i in range(n):
            _, _, samples, rate = clips[i % len(clips)]
            reuse = rng.random() < opts.media_reuse
            _, samples = audio_variant(samples, rate, None if reuse else seed * 1_000_003 + i)
            specs.append(RequestSpec("voice", [], opts.output_len, None, audio_pcm16=pcm16(samples, rate)))
    else:  # trace
        if not opts.trace_rows:
            raise ValueError("the trace workload needs trace rows (--trace FILE)")
        blk = opts.trace_block_tokens or 1
        for row in opts.trace_rows[:n]:
            if row.hash_ids:
                pieces, left = [], row.input_len
                for h in row.hash_ids:
                    if left <= 0:
                        break
                    take = min(blk, left)
                    # a full block is the shared text of its hash id; a partial last block is this request's
                    pieces.append(text.block(h, take, seed=seed) if take == blk else text.text(take, rng))
                    left -= take
                if left > 0:
                    pieces.append(text.text(left, rng))
                body = " ".join(pieces)
            else:
                body = text.text(row.input_len, rng)
            specs.append(RequestSpec("trace", [{"role": "user", "content": body}], row.output_len,
                                     row.input_len, arrival_s=row.t_s))
    if max_model_len is not None:
        for s in specs:
            if s.prompt_tokens is not None and s.prompt_tokens + s.max_tokens > max_model_len:
                raise ValueError(f"a {s.kind} request needs about {s.prompt_tokens} + {s.max_tokens} tokens but the "
                                 f"server's max_model_len is {max_model_len}; lower the lengths")
    return specs


def trace_options(path: Path, max_model_len: int, limit: int, scale: float | None,
                  start: int = 0) -> tuple[WorkloadOptions, float]:
    """WorkloadOptions for replaying ``path``: rows loaded, lengths scaled (leaving ~10 %
    of ``max_model_len`` for the chat template and rounding), block size scaled. Returns
    (options, scale)."""
    from epd.bench.traces import load_trace, scale_trace

    rows, scale = scale_trace(load_trace(path, limit=limit, start=start), int(max_model_len * 0.9), scale)
    return WorkloadOptions(trace_path=Path(path), trace_rows=rows, trace_block_tokens=block_tokens(scale)), scale


def spec_summary(specs: Sequence[RequestSpec]) -> dict:
    """Counts by kind and mean lengths of a request list (for the results JSON)."""
    kinds: dict[str, int] = {}
    for s in specs:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    pt = [s.prompt_tokens for s in specs if s.prompt_tokens is not None]
    return {"kinds": kinds, "mean_prompt_tokens": float(np.mean(pt)) if pt else None,
            "mean_max_tokens": float(np.mean([s.max_tokens for s in specs])) if specs else None,
            "images": int(sum(s.num_images for s in specs))}
