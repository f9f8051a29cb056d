"""Offline inference in vLLM's shape: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence as Seq

from transformers import AutoTokenizer

from epd.config import ConfigError, EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.errors import InvalidRequestError
from epd.models.checkpoints import resolve_model
from epd.outputs import RequestOutput
from epd.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a directory with config.json + safetensors, a .gguf file, or None
            for the embedded default (SmolLM2-135M-Instruct).
        audio_mode: "auto" (audio-native models embed, text-only LMs transcribe),
            "transcribe" (Whisper tiny.en speech front end: the transcript replaces
            each ``<|audio|>`` in the prompt text) or "embed" (audio tower embeddings).
        encoder_cache_gb: bound of the encoder (embedding) cache, GiB.
        video_fps / max_video_frames / max_video_seconds: frames sampled per second of
            video, at most this many per video, from videos at most this long (seconds).
        The remaining arguments are ``EngineConfig``'s (see there).

    Raises:
        epd.models.checkpoints.ModelNotFoundError / ModelLoadError: the model cannot be
            found or read; epd.config.ConfigError: an invalid setting.
    """

    def __init__(self, model: str | None = None, *, tensor_parallel_size: int = 1, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_prefill_tokens_with_decodes: int = 256, target_step_ms: float = 100.0,
                 max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, num_kv_blocks: int | None = None,
                 kv_cache_memory_gb: float = 2.0, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 device: str = "auto", seed: int = 0, kv_host_cache_gb: float = 0.0,
                 kv_disk_cache_dir: str | None = None, kv_disk_cache_gb: float = 0.0,
                 compile: bool = False, enforce_eager: bool = False, quantization: str | None = None,
                 audio_mode: str = "auto", encoder_cache_gb: float = 0.5, video_fps: float = 2.0,
                 max_video_frames: int = 32, max_video_seconds: float = 600.0,
                 speculative_config: dict | str | None = None) -> None:
        path = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = EngineConfig(str(path), tensor_parallel_size=tensor_parallel_size, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                              target_step_ms=target_step_ms,
                              max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                              num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
                              kv_host_cache_gb=kv_host_cache_gb, kv_disk_cache_dir=kv_disk_cache_dir,
                              kv_disk_cache_gb=kv_disk_cache_gb,
                              dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device, seed=seed, compile=compile,
                              enforce_eager=enforce_eager, quantization=quantization,
                              speculative_config=speculative_config)
        self.engine = LLMEngine(config, self.tokenizer)
        self._ids = itertools.count()
        # The engine is driven by one thread at a time; concurrent generate() calls
        # from several threads queue here instead of corrupting a step.
        self._lock = threading.Lock()
        self.model_dir = str(path)
        self._mm_processor = None
        self._encoder = None
        from epd.encoders.processor import model_modalities

        try:
            model_modalities(self.engine.config.hf_config, audio_mode)
        except ValueError as e:
            self.engine.shutdown()
            raise ConfigError(str(e)) from None
        self.audio_mode = audio_mode
        from epd.encoders.media_limits import MediaLimits

        try:
            self.media_limits = MediaLimits(max_video_frames=max_video_frames, max_video_seconds=max_video_seconds)
            from epd.encoders.video import VideoSampling

            self.video_fps = VideoSampling(fps=video_fps, max_frames=max_video_frames).fps
        except ValueError as e:
            self.engine.shutdown()
            raise ConfigError(str(e)) from None
        self.encoder_cache_bytes = int(encoder_cache_gb * 2**30)

    @property
    def mm_processor(self):
        """Media preprocessing and placeholder expansion for this model (lazy)."""
        if self._mm_processor is None:
            from epd.encoders.processor import MultiModalProcessor

            self._mm_processor = MultiModalProcessor(self.model_dir, self.engine.config.hf_config,
                                                     audio_mode=self.audio_mode, limits=self.media_limits,
                                                     video_fps=self.video_fps)
        return self._mm_processor

    @property
    def encoder(self):
        """The towers (or speech front end) with their encoder cache (lazy)."""
        if self._encoder is None:
            from epd.encoders.encoder_runner import EncoderRunner

            cfg = self.engine.config
            self._encoder = EncoderRunner(self.model_dir, cfg.hf_config, dtype=cfg.torch_dtype, device=cfg.device,
                                          cache_bytes=self.encoder_cache_bytes, audio_mode=self.audio_mode)
        return self._encoder

    def get_tokenizer(self):
        return self.tokenizer

    def _prepare(self, prompt: PromptType) -> tuple[str | None, list[int], dict]:
        """(text, token ids, engine kwargs for media) of one prompt.

        Raises InvalidRequestError / epd.encoders.media_limits.MediaError for bad input.
        """
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        proc = self.mm_processor
        if not mm_data and not proc.placeholder_ids:
            return (*self._to_token_ids(prompt), {})
        if not isinstance(prompt, dict):
            prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        mm_data = dict(mm_data or {})
        if "video" in mm_data and proc.modalities.get("video") != "embed":  # Qwen-VL: the processor's own
            prompt, mm_data = self._videos_as_frames(prompt, mm_data)
        if mm_data.get("audio") and proc.modalities.get("audio") == "transcribe":
            # A text-only LM hears audio through the speech front end: each
            # AUDIO_PLACEHOLDER in the prompt text becomes that clip's transcript.
            from epd.encoders.processor import AUDIO_PLACEHOLDER

            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise InvalidRequestError("audio for a text-only model needs a text prompt with "
                                          f"{AUDIO_PLACEHOLDER!r} where each clip goes", "prompt")
            audios = mm_data["audio"] if isinstance(mm_data["audio"], list) else [mm_data["audio"]]
            if text.count(AUDIO_PLACEHOLDER) != len(audios):
                raise InvalidRequestError(
                    f"the prompt has {text.count(AUDIO_PLACEHOLDER)} {AUDIO_PLACEHOLDER!r} placeholder(s) "
                    f"but {len(audios)} audio item(s) were given: put exactly one per item", "prompt")
            transcripts = self.encoder.transcribe([proc.audio_item(a) for a in audios])
            parts = text.split(AUDIO_PLACEHOLDER)
            text = parts[0] + "".join(t + rest for t, rest in zip(transcripts, parts[1:]))
            mm_data = {k: v for k, v in mm_data.items() if k != "audio"}
            prompt = {"prompt": text, "multi_modal_data": mm_data}
            if not mm_data:
                return (*self._to_token_ids(text), {})
        text, ids = self._to_token_ids({k: v for k, v in prompt.items() if k != "multi_modal_data"})
        processed = proc.process(ids, mm_data)
        if not processed.items:
            return text, processed.prompt_token_ids, {}
        embeddings = self.encoder.encode(processed.items)
        return text, processed.prompt_token_ids, {"mm_placeholders": processed.placeholders,
                                                   "mm_embeddings": embeddings}

    def _videos_as_frames(self, prompt: dict, mm_data: dict) -> tuple[dict, dict]:
        """A model that takes video as images (LLaVA): each ``VIDEO_PLACEHOLDER`` in the text
        prompt becomes that video's sampled frames as image placeholders, and the frames join
        ``mm_data["image"]`` in prompt order. Returns the new prompt and media.

        Raises:
            InvalidRequestError: the model takes no video, no text prompt, or placeholder
                counts that do not match the items.
        """
        import re

        from epd.encoders.video import VIDEO_PLACEHOLDER

        proc = self.mm_processor
        if proc.modalities.get("video") != "frames":
            raise InvalidRequestError("this model does not accept video", "multi_modal_data")
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            raise InvalidRequestError(f"video for this model needs a text prompt ('prompt', no 'prompt_token_ids') "
                                      f"with {VIDEO_PLACEHOLDER!r} where each video goes", "prompt")
        videos = mm_data.pop("video")
        videos = videos if isinstance(videos, list) else [videos]
        images = mm_data.get("image") or []
        images = list(images) if isinstance(images, list) else [images]
        image_tok = self.tokenizer.convert_ids_to_tokens(proc.placeholder_ids["image"])
        pieces = re.split(f"({re.escape(image_tok)}|{re.escape(VIDEO_PLACEHOLDER)})", text)
        slots = pieces[1::2]
        if slots.count(VIDEO_PLACEHOLDER) != len(videos) or slots.count(image_tok) != len(images):
            raise InvalidRequestError(
                f"the prompt has {slots.count(VIDEO_PLACEHOLDER)} {VIDEO_PLACEHOLDER!r} and {slots.count(image_tok)} "
                f"{image_tok!r} placeholder(s) for {len(videos)} video(s) and {len(images)} image(s): put exactly "
                "one per item", "prompt")
        videos_left, images_left, ordered = iter(videos), iter(images), []
        for k in range(1, len(pieces), 2):
            if pieces[k] == VIDEO_PLACEHOLDER:
                frames = proc.video_frames(next(videos_left))
                ordered += frames
                pieces[k] = image_tok * len(frames)
            else:
                ordered.append(next(images_left))
        return {"prompt": "".join(pieces)}, {**mm_data, "image": ordered}

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Seq) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a dict with 'prompt' / 'prompt_token_ids', "
            f"got {type(prompt).__name__}", "prompt")

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a token-id list, or a dict with ``prompt`` (or
        ``prompt_token_ids``) and optional ``multi_modal_data``:
        ``{"image": [PIL.Image | bytes, ...], "audio": [(samples, rate) | bytes, ...],
        "video": [bytes | uint8 array [T, H, W, 3], ...]}``; the prompt then carries the
        model's placeholder token (e.g. ``<image>``) once per item, in order. A video for a
        model that takes video as images (LLaVA) needs a text prompt with ``<video>``
        (``epd.encoders.video.VIDEO_PLACEHOLDER``) where it goes: its frames, sampled at
        ``video_fps`` (at most ``max_video_frames``), become image items there. A single token-id
        list counts as one prompt.
        Every prompt is validated (and its media encoded) before any runs, so an
        invalid one raises ``InvalidRequestError`` or ``MediaError`` and nothing
        is queued.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a token-id list, a dict or a list of those, "
                                      f"got {type(prompts).__name__}", "prompt")
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        with self._lock:
            return self._generate(prompts, params_list)

    def _generate(self, prompts: list, params_list: list[SamplingParams]) -> list[RequestOutput]:
        encoded = [self._prepare(p) for p in prompts]
        for (_, ids, _), sp in zip(encoded, params_list):
            self.engine.validate(ids, sp)
        order: dict[str, int] = {}
        for i, ((text, ids, mm), sp) in enumerate(zip(encoded, params_list)):
            rid = f"gen-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, ids, sp, prompt=text, **mm)
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
        finally:
            for rid, i in order.items():
                if results[i] is None:
                    self.engine.abort_request(rid)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate([{"prompt": p, "prompt_token_ids": i} for p, i in zip(prompts, ids)], sampling_params)

    def shutdown(self) -> None:
        self.engine.shutdown()
