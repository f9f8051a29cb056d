"""``epd launch``: router + worker pools + HTTP API in one command."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)


async def serve(plan, model_dir: Path, args, t0: float, worker_args: list[str]) -> int:
    """Start the router, spawn the workers, wait until all are ready, serve HTTP until stopped.

    Returns the process exit code. Every child is stopped on the way out.
    """
    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    from epd import metrics
    from epd.api.server import build_app
    from epd.encoders.processor import MultiModalProcessor
    from epd.launcher import Launcher, default_threads_per_worker
    from epd.router.router import Router

    metrics.setup_multiprocess_dir()
    router = Router(port=args.router_port)
    await router.start()
    num_procs = sum(p.devices for p in plan)
    threads = args.threads_per_worker or default_threads_per_worker(num_procs)
    launcher = Launcher(plan, model=str(model_dir), router_endpoint=router.endpoint, threads_per_worker=threads,
                        extra_worker_args=worker_args)
    try:
        launcher.start()

        def check_children() -> None:
            dead = launcher.poll_dead()
            if dead:
                raise RuntimeError("worker died during start-up: " + "; ".join(d.describe() for d in dead))

        expected: dict[str, int] = {}
        for p in plan:
            expected[p.role] = expected.get(p.role, 0) + p.instances
        await router.wait_ready(expected, args.ready_timeout, on_poll=check_children)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        processor = MultiModalProcessor(str(model_dir), hf_config)
        text_cfg = hf_config.get_text_config()
        max_model_len = args.max_model_len or text_cfg.max_position_embeddings
        model_name = args.model or "SmolLM2-135M-Instruct"
        app = build_app(router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                        metrics_render=metrics.render_latest, metrics=metrics.get_metrics())
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        pools = ",".join(f"{p.role}:{p.devices}" for p in plan)
        print(f"epd: serving {model_name} on http://{args.host}:{args.port} (pools {pools}; "
              f"ready in {time.monotonic() - t0:.1f} s)", flush=True)
        await server.serve()
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"epd launch: {e}", file=sys.stderr)
        return 1
    finally:
        await router.stop()
        launcher.stop()
