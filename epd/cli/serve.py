"""``epd serve``: the router and the HTTP API; worker pools join from any host (``epd worker``)."""

from __future__ import annotations

import argparse
import time

from epd.cli.args import add_api_args, add_recovery_args, add_routing_args
from epd.cli.validators import positive_int
from epd.launch.config import LaunchConfig


def add_parser(sub) -> None:
    """``epd serve``: the API and router; the pools join it (``epd worker``)."""
    d = LaunchConfig()
    s = sub.add_parser("serve", help="serve the HTTP API and the router; worker pools join from any host "
                                     "(`epd worker --router tcp://HOST:PORT`)")
    s.add_argument("--model", default=d.model,
                   help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct (the workers' model)")
    s.add_argument("--host", default=d.host, help="HTTP address (default: %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="HTTP port (default: %(default)s)")
    s.add_argument("--router-host", default=d.router_host,
                   help="address the router's ZeroMQ socket binds; anything but loopback needs --cluster-keys "
                        "(default: %(default)s)")
    s.add_argument("--router-port", type=int, default=5557, help="router's ZeroMQ port (default: %(default)s)")
    s.add_argument("--pools", default=d.pools,
                   help="live instances each pool needs before /health answers 200, e.g. e:1,p:1,d:1 or p:1,d:1 "
                        "(default: %(default)s)")
    s.add_argument("--cluster-keys", default=d.cluster_keys,
                   help="directory of the cluster's CURVE keys (`epd keys generate`) (default: $EPD_CLUSTER_KEYS)")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output served (default: the model's)")
    add_routing_args(s.add_argument_group("routing"), d)
    add_recovery_args(s.add_argument_group("failure recovery"), d, launcher=False)
    add_api_args(s.add_argument_group("OpenAI API"), d)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """``epd serve``: the router and the API only; workers join with ``epd worker``."""
    import asyncio

    from epd.cluster_auth import ROUTER, load_keys, require_keys
    from epd.launch.api_process import serve
    from epd.launch.ports import check_port_free
    from epd.launch.spec import parse_pools
    from epd.models.checkpoints import resolve_model

    t0 = time.monotonic()
    config = LaunchConfig.from_args(args)
    require_keys(config.router_host, load_keys(config.cluster_keys, ROUTER), "router's control socket", "--router-host")
    min_pools = dict(parse_pools(config.pools))
    http_socket = check_port_free(config.host, config.port, keep=True)
    check_port_free(config.router_host, config.router_port, flag="--router-port")
    path = resolve_model(config.model)
    return asyncio.run(serve(config, path, t0, http_socket=http_socket, min_pools=min_pools))
