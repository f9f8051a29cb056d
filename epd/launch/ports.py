"""Whether a TCP server could listen on a host's port, before anything is started.

Every refusal is a :class:`~epd.launch.spec.LaunchSpecError` whose message names the
flag to change.
"""

from __future__ import annotations

import errno
import socket

from epd.launch.spec import LaunchSpecError

__all__ = ["check_port_free", "find_free_port"]


def _resolve_host(host: str, port: int) -> tuple:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LaunchSpecError(f"cannot resolve host {host!r} ({e.strerror}): pass an address such as "
                              "--host 127.0.0.1 or --host 0.0.0.0") from None
    return infos[0]


def check_port_free(host: str, port: int, keep: bool = False, flag: str = "--port") -> socket.socket | None:
    """Raise :class:`LaunchSpecError` unless a TCP server could listen on ``host:port``.

    Binds (with SO_REUSEADDR, as uvicorn does, so sockets in TIME_WAIT don't count)
    a socket and releases it, or with ``keep`` returns it bound (not listening) so
    that nothing else - the workers' own ZeroMQ/UCX ports included - takes the port
    while the workers start; the HTTP server then serves on it. Port 0 (pick any)
    is always free.
    """
    if not 0 <= port <= 65535:
        raise LaunchSpecError(f"port {port} is out of range: pick one in 1..65535 with {flag}")
    family, socktype, proto, _, addr = _resolve_host(host, port)
    s = socket.socket(family, socktype, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise LaunchSpecError(f"port {port} on {host} is already in use: pick another with {flag}") from None
        if e.errno == errno.EACCES:
            raise LaunchSpecError(f"no permission to listen on port {port} on {host} (ports below 1024 "
                                  f"need privileges): pick another with {flag}") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LaunchSpecError(f"address {host} is not an address of this machine: pass one it has, "
                                  "e.g. --host 127.0.0.1") from None
        raise LaunchSpecError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    if keep:
        return s
    s.close()
    return None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it before you
    bind; prefer binding to port 0 directly, e.g. zmq ``bind_to_random_port``)."""
    family, socktype, proto, _, addr = _resolve_host(host, 0)
    with socket.socket(family, socktype, proto) as s:
        s.bind(addr)
        return s.getsockname()[1]
