"""Realtime voice API: the documented subset of OpenAI's Realtime API at ``/v1/realtime``.

A WebSocket carries JSON events both ways, shaped as the official ``openai`` SDK's
realtime client (``client.realtime.connect()``, openai >= 2) parses and sends them, so
that client drives epd unchanged with ``base_url="http://HOST:PORT/v1"``. Source:
OpenAI's Realtime API reference (client and server events) and the SDK's types in
``openai/types/realtime``.

Client events handled:

* ``session.update``: ``instructions`` (system prompt), ``max_output_tokens`` (int or
  ``"inf"``; default 256), ``output_modalities`` (``["audio"]``, the default when the
  server has a tts pool, as OpenAI's; else ``["text"]``, the default and only choice),
  ``audio.input.format`` (``{"type": "audio/pcm", "rate": R}``: PCM16 little-endian mono,
  R from 8000 to 48000 Hz, default 24000; epd resamples with torchaudio; or
  ``audio/pcmu`` / ``audio/pcma``: G.711 at 8 kHz), ``audio.output.format`` (the same
  types; ``audio/pcm`` at 24000 Hz only, as OpenAI's), ``audio.output.voice`` (one of
  OpenAI's voice names, ``epd.api.realtime.protocol.VOICES``; each maps to an eSpeak NG
  voice), ``audio.output.speed`` (accepted, echoed),
  ``audio.input.turn_detection``: ``server_vad`` (the default, as OpenAI's: ``threshold``,
  ``prefix_padding_ms``, ``silence_duration_ms``, ``create_response``,
  ``interrupt_response``; ``semantic_vad`` runs as ``server_vad``, ``idle_timeout_ms`` (5000..30000; see
  below)) or ``null`` / ``false`` (the client commits turns), ``audio.input.transcription`` and
  ``audio.input.noise_reduction`` (accepted and echoed, not acted on: text-only models
  always transcribe with the speech front end, input audio is not filtered), and the
  epd extension ``temperature`` (default 0: greedy), ``tools`` and ``tool_choice`` (see
  Tools below). Other OpenAI fields are ignored.
* ``input_audio_buffer.append`` (base64 PCM16 in the session format; at most
  ``MAX_APPEND_BYTES`` decoded bytes per event and ``MAX_BUFFER_SECONDS`` buffered),
  ``input_audio_buffer.commit`` (at least ``MIN_COMMIT_MS`` of audio),
  ``input_audio_buffer.clear``.
* ``conversation.item.create``: a ``message`` with role ``user`` (``input_text`` /
  ``input_audio`` parts), ``assistant`` (``output_text``) or ``system`` (``input_text``),
  a ``function_call`` (an earlier call) or a ``function_call_output`` (a call's result);
  ``previous_item_id`` (``"root"``, an item id, or none: append).
  ``conversation.item.delete``, ``conversation.item.retrieve``. A session holds at most ``MAX_ITEMS`` items and
  ``MAX_SESSION_BYTES`` of text and audio (a transcribed clip's audio is not kept).
* ``response.create``: ``instructions``, ``max_output_tokens``, ``output_modalities``,
  ``metadata``, ``conversation`` (``"auto"`` or ``"none"``), ``input`` (items or
  ``item_reference``\\ s instead of the conversation), epd extension ``temperature``.
  ``audio.output.voice`` / ``.format`` for this response.
* ``response.cancel`` (optional ``response_id``).
* ``conversation.item.truncate`` (``item_id``, ``content_index``, ``audio_end_ms``): the
  client played only that much of an assistant's audio; the item's transcript is cut to
  the characters spoken by then (from the per-phrase marks the response kept), so the
  next turn's prompt holds only what the user heard. ``audio_end_ms`` past the item's
  audio is an error (param ``audio_end_ms``).
* ``output_audio_buffer.clear`` (answered ``output_audio_buffer.cleared``; audio is
  streamed as it is made, so there is no server-side buffer to clear).

Server VAD (``epd.api.realtime.vad``: Silero VAD, run in the API's CPU pool): appended audio is
scored in 32 ms windows; a turn's onset sends ``input_audio_buffer.speech_started``
(``audio_start_ms``: the onset less ``prefix_padding_ms``; ``item_id``: the item it will
commit to) and cancels a streaming answer (``interrupt_response``); ``silence_duration_ms``
of silence after it sends ``input_audio_buffer.speech_stopped`` (``audio_end_ms``), commits
the turn's audio and, with ``create_response``, answers it as ``response.create`` with
the session's settings would. Between turns the buffer keeps only the prefix padding.
A manual ``input_audio_buffer.commit`` still works and ends the turn in progress.

Server events sent: ``session.created``, ``session.updated``,
``input_audio_buffer.speech_started`` / ``speech_stopped`` / ``timeout_triggered``, ``input_audio_buffer.committed``,
``input_audio_buffer.cleared``, ``conversation.item.added`` and ``conversation.item.done``
(the GA names; ``conversation.item.created``, the beta name, is sent too),
``conversation.item.retrieved``, ``conversation.item.deleted``,
``conversation.item.input_audio_transcription.completed`` / ``.failed`` (text-only
models: what the speech front end heard), ``response.created``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, ``response.output_text.done`` (audio responses:
``response.output_audio.delta`` / ``.done`` and ``response.output_audio_transcript.delta`` /
``.done`` instead), ``response.function_call_arguments.delta`` / ``.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.done`` (status
``completed``, ``incomplete`` (max_output_tokens), ``cancelled`` (``client_cancelled``
or ``turn_detected``) or ``failed``; with ``usage``), ``error`` (``error.event_id`` names
the client event at fault). Every malformed, unknown or unsupported event gets an
``error`` event and the session goes on. Frames over uvicorn's 16 MiB message limit
close the socket (code 1009).

Limits: at most ``max_realtime_sessions`` sessions at once (one more gets an ``error``
event, code ``session_limit_reached``, and close code 1013); a response, and each audio
clip being transcribed (an encode job: from its commit, ``conversation.item.create`` or
``response.create`` until its transcript), count toward ``max_pending_requests`` with the
HTTP requests, and a session transcribes at most ``MAX_SESSION_TRANSCRIPTIONS`` clips at
once (over either: an ``error`` event, code ``rate_limit_exceeded``, and the event's work
is not done: the item is not added, the audio stays buffered; the session goes on).
Deleting an item stops its transcription (its encode request is aborted), unless the
response in flight was given it; closing the session stops them all. A session that
sends no event for ``realtime_idle_timeout_s`` while none of its responses or
transcriptions runs gets an ``error`` event, code ``session_idle_timeout``, and close code
1000, freeing its slot (WebSocket pings are not events); a client that stops reading its events
while ``MAX_OUTBOUND_BYTES`` wait for it is closed with code 1008. The handshake checks
the API key (1008) and a browser's ``Origin`` header against ``allowed_origins`` (403;
clients that send none pass). The endpoint (handshake, what sessions share) is
``epd.api.realtime.server``; the limits are ``epd.api.server.ApiSettings``.

epd extension event ``response.output_text.segment`` (``response_id``, ``item_id``,
``output_index``, ``content_index``, ``segment_index``, ``text``, ``reason``): the
response's text cut into TTS-ready phrases (sentence ends, clause marks past a minimum
length, a maximum length, never inside a word; see ``epd.api.realtime.segmenter``); the
segments of a response concatenate to exactly its deltas, the last one arriving before
``response.output_text.done``.

Audio: committed speech goes through the E pool: the Whisper tiny.en speech front end
for text-only LMs (the transcript becomes the user's text; transcription starts at
commit), or the encoder tower for audio-native LMs (Qwen2-Audio: embeddings). The
conversation (per session) renders through the model's chat template for every
response, so each turn's prompt extends the last one's and the prefix cache makes
later turns cheap (``usage.input_token_details.cached_tokens``). Conversations past
``max_model_len`` drop their oldest items (OpenAI's ``truncation: "auto"``).

Barge-in: ``response.cancel``, or speech committed while a response streams, stops the
response at once: its router request is closed, which aborts it on every worker (the
decode slot and KV blocks are freed), the rest of its held text goes out as a last
segment (reason ``cancelled``), and ``response.done`` has status ``cancelled``; no delta
of that response follows it. Closing the socket does the same.

Speech out (``--pools ...,t:N``, ``epd.workers.tts_worker``): an audio response's text
is cut into phrases (the segments above) and each phrase is synthesized on the tts pool
as soon as it is complete, while decode goes on; its audio streams as
``response.output_audio.delta`` (base64, in the session's output format) and its text as
``response.output_audio_transcript.delta``, then ``response.output_audio.done`` and
``response.output_audio_transcript.done``. Barge-in stops synthesis too (the tts
request is aborted) and keeps, as the item's transcript, the text already spoken.

Idle timeout (``turn_detection.idle_timeout_ms``): that much input audio with no speech
after a response (counted from the end of its audio, as a client playing it as it
arrives hears it) sends ``input_audio_buffer.timeout_triggered`` (``audio_start_ms``,
``audio_end_ms``, ``item_id``), commits the buffered silence to that item and answers it
(``create_response``), so the assistant can prompt a silent user. The clock is the input
audio's (what was appended), not the wall clock.

Tools (``epd.api.realtime.tools``): ``session.tools`` / ``tool_choice`` (and per
``response.create``), OpenAI's flat function tools, run through the chat API's tool
machinery (``epd.api.tools``: the chat template or a system message shows them;
``required`` or a named function forces a valid call by grammar). Calls stream as
``function_call`` output items with ``response.function_call_arguments.delta`` /
``.done``; the client's ``function_call_output`` items go into the next prompt as tool
results.

Modules: ``server`` (the endpoint: handshake, what sessions share), ``session`` (one
socket's events, its settings and input audio buffer; the limits ``MAX_BUFFER_SECONDS``,
``MAX_ITEMS``, ``MAX_SESSION_BYTES``, ``MAX_OUTBOUND_BYTES``), ``connection`` (the
socket's bounded outbound queue), ``protocol`` (client event shapes and field checks;
``MAX_APPEND_BYTES``, ``MIN_COMMIT_MS``), ``conversation`` (items, parts, responses),
``prompt`` (items -> router request), ``responses`` (the response task, speech out),
``transcribe`` (speech -> text in the E pool; ``MAX_SESSION_TRANSCRIPTIONS``), ``tools`` (function calling),
``segmenter`` (TTS-ready phrases), ``vad`` (server VAD), ``audio_formats`` (PCM16, G.711).
"""

from epd.api.realtime.server import RealtimeAPI, mount_realtime

__all__ = ["RealtimeAPI", "mount_realtime"]
