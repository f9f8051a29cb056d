"""Send one benchmark request and time it: OpenAI chat completions (streaming SSE,
through the official ``openai`` SDK) or a Realtime voice turn over ``/v1/realtime``
(the SDK's realtime client).

Clocks: ``time.perf_counter``. ``RequestRecord.chunk_s`` holds the arrival time of each
chunk that carries text (SSE ``delta.content`` / ``response.output_text.delta``)
relative to the send (chat: the HTTP request; voice: the ``input_audio_buffer.commit``,
i.e. the end of the user's speech, sent together with ``response.create``).

Output token count ``n_out``: the server's usage (``stream_options.include_usage`` /
``response.done``) when it reports one (``n_out_source = "usage"``); else, when the
request stopped on its length limit, ``max_tokens`` (``"max_tokens"``); else the number
of text chunks (``"chunks"``, a lower bound when a chunk carries several tokens).
"""

from __future__ import annotations

import base64
import time

from epd.bench.metrics import RequestRecord
from epd.bench.workloads import RequestSpec

#: bytes of PCM16 per input_audio_buffer.append event (about 0.5 s at 24 kHz)
VOICE_APPEND_BYTES = 24000


def _finish_count(rec: RequestRecord, usage_tokens: int | None, spec: RequestSpec) -> None:
    if usage_tokens is not None:
        rec.n_out, rec.n_out_source = usage_tokens, "usage"
    elif rec.finish_reason == "length":
        rec.n_out, rec.n_out_source = spec.max_tokens, "max_tokens"
    else:
        rec.n_out, rec.n_out_source = len(rec.chunk_s), "chunks"


async def send_chat(client, model: str, spec: RequestSpec, rec: RequestRecord, *, ignore_eos: bool = True,
                    include_usage: bool = True, temperature: float = 0.0,
                    extra_body: dict | None = None) -> RequestRecord:
    """Stream one chat completion with ``client`` (``openai.AsyncOpenAI``) and fill ``rec``.
    ``extra_body``: fields outside the OpenAI schema (a server's own way to force a length).
    Never raises for a failed request: ``rec.ok`` is False and ``rec.error`` says why."""
    extra = {**({"ignore_eos": True} if ignore_eos else {}), **(extra_body or {})} or None
    t0 = time.perf_counter()
    usage_tokens = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=spec.messages, max_tokens=spec.max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True} if include_usage else None, extra_body=extra)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta is not None and choice.delta.content:
                        rec.chunk_s.append(now)
                    if choice.finish_reason:
                        rec.finish_reason = choice.finish_reason
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                    rec.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    rec.cached_tokens = details.cached_tokens if details is not None else None
        rec.e2e_s = time.perf_counter() - t0
        _finish_count(rec, usage_tokens, spec)
        rec.ok = bool(rec.chunk_s)
        if not rec.ok:
            rec.error = "no content in the stream"
    except Exception as e:  # any failure is a result of the benchmark, not a crash of it
        hint = ""
        said = f"{e} {getattr(e, 'body', '')}"  # the SDK's message and the parsed error body
        if ignore_eos and getattr(e, "status_code", None) in (400, 422) and "ignore_eos" in said:
            # ignore_eos is a vLLM extension: OpenAI itself and e.g. `transformers serve` refuse it
            # (by name; other 400s, e.g. a prompt over max_model_len, get no hint)
            hint = " (the server may not accept the ignore_eos extension: rerun with --no-ignore-eos)"
        rec.ok, rec.error = False, (f"{type(e).__name__}: {e}"[:500] + hint)
    return rec


async def send_voice(client, model: str, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
    """One Realtime turn: connect to ``/v1/realtime``, turn server VAD off, append the clip
    (PCM16 24 kHz, in ~0.5 s events), commit, ``response.create``, read ``response.output_text.delta``
    events until ``response.done``. Fills ``rec``; never raises for a failed turn."""
    t0 = time.perf_counter()
    try:
        async with client.realtime.connect(model=model) as conn:
            # the client commits (no server VAD): the turn ends exactly when the clip does
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            audio = spec.audio_pcm16 or b""
            for i in range(0, len(audio), VOICE_APPEND_BYTES):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + VOICE_APPEND_BYTES]).decode())
            t0 = time.perf_counter()
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"max_output_tokens": spec.max_tokens})
            usage_tokens = None
            async for event in conn:
                now = time.perf_counter() - t0
                if event.type == "response.output_text.delta" and event.delta:
                    rec.chunk_s.append(now)
                elif event.type == "error":
                    raise RuntimeError(f"server error event: {getattr(event.error, 'message', event.error)}")
                elif event.type == "response.done":
                    resp = event.response
                    status = getattr(resp, "status", None)
                    if status not in (None, "completed", "incomplete"):
                        raise RuntimeError(f"response ended with status {status!r}")
                    usage = getattr(resp, "usage", None)
                    usage_tokens = getattr(usage, "output_tokens", None) if usage is not None else None
                    rec.finish_reason = "length" if status == "incomplete" else "stop"
                    break
        rec.e2e_s = time.perf_counter() - t0
        _finish_count(rec, usage_tokens, spec)
        rec.ok = bool(rec.chunk_s)
        if not rec.ok:
            rec.error = "no text delta before response.done"
    except Exception as e:
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"[:500]
    return rec
