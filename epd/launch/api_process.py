"""The API process of ``epd serve`` (router + HTTP API; workers join from any host) and
``epd launch`` (the same, plus every worker process on this host)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from epd.launch.config import LaunchConfig
from epd.roles import Role

logger = logging.getLogger(__name__)


def api_key(config: LaunchConfig) -> str | None:
    """The API key: ``config.api_key``, else ``$EPD_API_KEY``; None when neither is set (or empty).

    Raises:
        LaunchSpecError: ``config.require_api_key`` and no key.
    """
    key = config.api_key or os.environ.get("EPD_API_KEY") or None
    if key is None and config.require_api_key:
        from epd.launch.spec import LaunchSpecError

        raise LaunchSpecError("--require-api-key: no API key given, so the API would serve anyone. Pass --api-key "
                              "KEY or set $EPD_API_KEY (on Kubernetes: the Secret epd-api-key, deploy/README.md)")
    return key


def api_settings(config: LaunchConfig):
    """``ApiSettings`` from ``epd launch``'s API flags; the key falls back to ``$EPD_API_KEY``."""
    from epd.api.server import ApiSettings

    domains = [d for d in config.allowed_media_domains.split(",") if d.strip()]
    origins = [o.strip() for o in config.allowed_origins.split(",") if o.strip()]
    return ApiSettings(api_key=api_key(config),
                       max_body_bytes=int(config.max_body_mb * 2**20),
                       max_inflight_body_bytes=int(config.max_inflight_body_mb * 2**20),
                       max_pending_requests=config.max_pending_requests,
                       max_n=config.max_n, allowed_media_domains=tuple(domains),
                       media_fetch_timeout_s=config.media_fetch_timeout,
                       max_media_bytes=int(config.max_media_mb * 2**20),
                       max_realtime_sessions=config.max_realtime_sessions, allowed_origins=tuple(origins),
                       realtime_idle_timeout_s=config.realtime_idle_timeout or None,
                       tool_call_parser=config.tool_call_parser,
                       model_aliases=tuple((config.served_model_name or [])[1:]))


async def serve(config: LaunchConfig, model_dir: Path, t0: float, *, plan=None, worker_args: list[str] = (),
                http_socket: socket.socket | None = None, min_pools: dict[str, int] | None = None) -> int:
    """The router and the HTTP API; with ``plan`` (``epd launch``) also the worker processes.

    - ``epd serve`` (no ``plan``): workers join from anywhere (``epd worker --router``);
      ``/health`` answers 503 until ``min_pools`` (live instances per role) are there.
    - ``epd launch``: spawns ``plan``'s workers on this host with fresh cluster keys
      (unless ``config.cluster_keys`` names some), waits until every one is ready,
      and supervises them (restarts); ``/health`` needs them all.

    ``http_socket``: ``config.host:config.port`` already bound (not listening), as
    :func:`epd.launch.ports.check_port_free` keeps it; None binds the port when serving.
    Returns the process exit code. Every child is stopped on the way out.

    Raises:
        ClusterKeysError: a non-loopback router address without keys, or unreadable keys.
        LaunchSpecError: ``config.require_api_key`` without an API key.
    """
    from epd import metrics
    from epd.cluster_auth import ROUTER, load_keys
    from epd.launch.supervisor import supervise
    from epd.models.checkpoints import model_fingerprint
    from epd.router.router import Router

    api_key(config)  # --require-api-key: refuse before anything starts
    metrics.setup_multiprocess_dir()
    with contextlib.ExitStack() as cleanup:
        keys = load_keys(_cluster_keys_dir(config, plan is not None, cleanup), ROUTER)
        router = Router(host=config.router_host, port=config.router_port, stage_timeout_s=config.stage_timeout,
                        token_timeout_s=config.token_timeout, max_retries=config.max_retries,
                        kv_failure_policy=config.kv_failure_policy, encode_routing=config.encode_routing,
                        prefill_routing=config.prefill_routing, decode_routing=config.decode_routing,
                        kv_overlap_weight=config.kv_overlap_weight, keys=keys, model=model_fingerprint(model_dir),
                        video_encode_split=config.video_encode_split, forget_dead_after_s=config.forget_dead_after,
                        remote_prefix_reads=config.remote_prefix_reads)
        await router.start()
        launcher = None
        try:
            if plan is not None:
                launcher = _start_workers(plan, model_dir, config, router, list(worker_args), keys)
                await _wait_for_workers(router, launcher, plan, config.ready_timeout)
            else:
                router.min_pools = dict(min_pools or {})
            server, sock, model_name = await _http_server(config, model_dir, router, http_socket,
                                                          launched=plan is not None)
            port = sock.getsockname()[1] if sock is not None else config.port
            pools = ",".join(f"{r}:{n}" for r, n in router.min_pools.items())
            if plan is not None:
                print(f"epd: serving {model_name} on http://{config.host}:{port} (pools {pools}; "
                      f"ready in {time.monotonic() - t0:.1f} s)", flush=True)
            else:
                print(f"epd: serving {model_name} on http://{config.host}:{port}; workers join at {router.endpoint}"
                      f" (cluster keys: {'yes' if keys else 'none, loopback only'}); /health is 200 once the pools "
                      f"have {pools or 'one instance each'}", flush=True)
            supervisor = (asyncio.create_task(supervise(launcher, router, config.max_worker_restarts))
                          if launcher is not None else None)
            try:
                await server.serve(sockets=[sock] if sock is not None else None)
            finally:
                if supervisor is not None:
                    supervisor.cancel()
            return 0
        except (RuntimeError, TimeoutError) as e:
            print(f"epd {'launch' if plan is not None else 'serve'}: {e}", file=sys.stderr)
            return 1
        finally:
            # `epd serve` leaves remote workers running: they notice the lost router and re-join the next one.
            await router.stop(shutdown_workers=launcher is not None)
            if launcher is not None:
                launcher.stop()


def _cluster_keys_dir(config: LaunchConfig, launching: bool, cleanup: contextlib.ExitStack) -> str | None:
    """The cluster keys' directory: ``config.cluster_keys``; else, for ``epd launch`` without
    ``$EPD_CLUSTER_KEYS``, fresh keys in a temporary directory that ``cleanup`` removes
    (this launch's own cluster: only its workers can join); else None (``$EPD_CLUSTER_KEYS``
    or no keys, as :func:`epd.cluster_auth.load_keys` decides)."""
    if not launching or config.cluster_keys is not None or os.environ.get("EPD_CLUSTER_KEYS"):
        return config.cluster_keys
    from epd.cluster_auth import generate_keys

    keys_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="epd-keys-")) + "/keys"
    generate_keys(keys_dir)
    return keys_dir


def _start_workers(plan, model_dir: Path, config: LaunchConfig, router, worker_args: list[str], keys):
    """Spawn ``plan``'s worker processes on this host (``epd launch``), joined to ``router``."""
    from epd.launch.supervisor import Launcher

    if keys is not None:
        worker_args = [*worker_args, "--cluster-keys", str(keys.directory)]
    launcher = Launcher(plan, model=str(model_dir), router_endpoint=router.endpoint,
                        threads_per_worker=config.threads_per_worker, extra_worker_args=worker_args)
    launcher.start()
    return launcher


async def _wait_for_workers(router, launcher, plan, timeout_s: float) -> None:
    """Wait until every instance of ``plan`` has joined ``router`` (``/health`` then needs them all).

    Raises:
        RuntimeError: a worker process exited meanwhile (the message says which and how).
        TimeoutError: not all were ready within ``timeout_s`` seconds.
    """
    expected: dict[Role, int] = {}
    for p in plan:
        expected[p.role] = expected.get(p.role, 0) + p.instances
    router.min_pools = dict(expected)

    def check_children() -> None:
        dead = launcher.poll_dead()
        if dead:
            raise RuntimeError("worker died during start-up: " + "; ".join(d.describe() for d in dead))

    await router.wait_ready(expected, timeout_s, on_poll=check_children)


async def _http_server(config: LaunchConfig, model_dir: Path, router, http_socket: socket.socket | None, *,
                       launched: bool):
    """The HTTP API over ``router``: ``(uvicorn server, its socket (listening; None: uvicorn
    binds config.host:config.port), the model name it reports)``. The served
    ``max_model_len`` is ``config.max_model_len`` (default: the model's), and with
    ``launched`` workers no more than the smallest any of them reports."""
    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    from epd import metrics
    from epd.api.app import build_app
    from epd.encoders.media_limits import MediaLimits
    from epd.encoders.processor import MultiModalProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    processor = MultiModalProcessor(str(model_dir), hf_config, video_fps=config.video_fps,
                                    limits=MediaLimits(max_video_frames=config.max_video_frames,
                                                       max_video_seconds=config.max_video_seconds,
                                                       max_item_bytes=int(config.max_mm_item_mb * 2**20)))
    text_cfg = hf_config.get_text_config()
    max_model_len = config.max_model_len or text_cfg.max_position_embeddings
    if launched:
        # A worker whose KV cache holds fewer tokens lowers its max_model_len: serve the smallest.
        lens = [int(st["max_model_len"]) for st in (await router.worker_stats(timeout_s=30.0)).values()
                if "max_model_len" in st]
        max_model_len = min([max_model_len, *lens])
    model_name = (config.served_model_name or [config.model or "SmolLM2-135M-Instruct"])[0]
    app = build_app(router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                    metrics_render=metrics.render_latest, metrics=metrics.get_metrics(),
                    settings=api_settings(config), vocab_size=text_cfg.vocab_size)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", lifespan="off")
    server = uvicorn.Server(uv_config)
    if http_socket is not None:
        http_socket.listen(uv_config.backlog)  # connections made from here on queue until uvicorn accepts
    return server, http_socket, model_name
