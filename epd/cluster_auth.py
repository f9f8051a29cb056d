"""The cluster's keys: CURVE authentication and encryption of every ZeroMQ socket.

Two CURVE key pairs, written by ``epd keys generate DIR`` as the certificate files of
``zmq.auth`` (pyzmq):

- the **router** pair (``router.key``, ``router.key_secret``), held by the router's
  process only (``epd serve`` / ``epd launch``): it alone may send *commands* to workers;
- the **member** pair (``member.key``, ``member.key_secret``), held by every worker
  (``epd worker``, each pool): it may only *report* to the router.

Each side holds its own secret and the other side's public key, and only ever talks to
the other side: a worker's command socket admits the router's key and nothing else, and
the router's inbox admits the member key and nothing else. So a stolen member key (any
worker's or encoder's) cannot send ``Shutdown``, ``PeerInfo``, ``Registered`` or any
command to another worker, nor pose as the router to one.

- a socket that **binds** (the router's inbox, a worker's command socket) is a CURVE
  server with a ZAP handler (``zmq.auth``'s authenticator) that admits only the other
  side's public key, with ``ZAP_ENFORCE_DOMAIN`` on, so no handler means no connection
  (fail closed); each refusal is logged and reported to ``on_denied``;
- a socket that **connects** is a CURVE client with its side's key pair and the other
  side's public key as the server's key.

A peer without the right secret never completes the handshake, so none of its bytes
reach a message decoder, let alone router or worker logic. Without keys a process may
bind loopback only (:func:`require_keys`): any local user could otherwise join.

Reference: ZeroMQ RFC 26 (CurveZMQ) and RFC 27 (ZAP); pyzmq's ``zmq.auth``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

__all__ = ["ClusterKeys", "ClusterKeysError", "generate_keys", "is_loopback", "load_keys", "require_keys",
           "KEYS_ENV", "MEMBER", "ROUTER", "ZAP_DOMAIN"]

logger = logging.getLogger(__name__)

#: environment variable naming the keys directory when ``--cluster-keys`` is not given
KEYS_ENV = "EPD_CLUSTER_KEYS"
ZAP_DOMAIN = "epd"
ROUTER = "router"  # the router's side: commands to workers
MEMBER = "member"  # every worker's side: reports to the router
_PEER = {ROUTER: MEMBER, MEMBER: ROUTER}
_LEGACY = "cluster"  # the single shared pair of earlier versions
_DENIED_LOG_S = 10.0  # one warning per this many seconds per refused key (ZeroMQ retries the handshake)


class ClusterKeysError(ValueError):
    """The keys are missing or unreadable, or a bind needs keys that were not given."""


@dataclass(frozen=True)
class ClusterKeys:
    """One side's CURVE key pair and the other side's public key (Z85-encoded, 40 bytes each).

    ``side``: ``"router"`` or ``"member"``; ``peer_public``: the public key of the other
    side, the only client key this side's servers admit and the server key its clients
    expect; ``directory``: where they were read.
    """

    side: str
    public: bytes
    secret: bytes
    peer_public: bytes
    directory: Path

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that only ZAP-admitted clients reach."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the other side's server."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.peer_public

    def start_authenticator(self, ctx: zmq.Context, on_denied: Callable[[], None] | None = None):
        """Start the ZAP handler of ``ctx`` (a ``zmq.Context`` or ``zmq.asyncio.Context``:
        the handler thread shares its libzmq context, as ZAP's inproc endpoint requires),
        admitting only ``peer_public``. ``on_denied`` is called (on the handler's thread)
        for every refused handshake. Returns it; call ``.stop()`` before terminating the
        context."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_PeerOnly(self, on_denied))
        return auth


class _PeerOnly:
    """ZAP credentials provider (pyzmq's ``configure_curve_callback``): admits the other
    side's public key only; logs (at most every ``_DENIED_LOG_S`` per key) and counts the rest."""

    def __init__(self, keys: ClusterKeys, on_denied: Callable[[], None] | None) -> None:
        self.keys, self.on_denied = keys, on_denied
        self._logged: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.keys.peer_public:
            return True
        if self.on_denied is not None:
            self.on_denied()
        now = time.monotonic()
        with self._lock:
            if now - self._logged.get(key, -_DENIED_LOG_S) < _DENIED_LOG_S:
                return False
            if len(self._logged) > 1024:
                self._logged.clear()
            self._logged[key] = now
        who = ("only the router's key may send commands to a worker" if self.keys.side == MEMBER
               else "only the member key may report to the router")
        logger.warning("refused a CURVE client with key %s...: %s (a stolen or mismatched key? see "
                       "docs/architecture.md, Threat model)", key[:8].decode(errors="replace"), who)
        return False


def generate_keys(directory: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a new router key pair and member key pair into ``directory`` (created, mode
    0700): ``router.key``, ``router.key_secret``, ``member.key``, ``member.key_secret``
    (secret files mode 0600). Returns the directory.

    The router's process needs ``router.key_secret`` and ``member.key``; every worker
    ``member.key_secret`` and ``router.key`` (one directory holding all four serves both
    on one host).

    Raises:
        ClusterKeysError: keys already exist there and ``force`` is False.
    """
    d = Path(directory)
    existing = [d / f"{side}.key_secret" for side in (ROUTER, MEMBER) if (d / f"{side}.key_secret").exists()]
    if existing and not force:
        raise ClusterKeysError(f"{existing[0]} exists: keep using those keys, or pass --force to replace them "
                               "(every process of the cluster then needs the new ones)")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for side in (ROUTER, MEMBER):
        _, secret = zmq.auth.create_certificates(str(d), side)
        os.chmod(secret, 0o600)
    return d


def load_keys(directory: str | os.PathLike | None, side: str) -> ClusterKeys | None:
    """``side``'s keys (``ROUTER`` or ``MEMBER``) in ``directory``, else in ``$EPD_CLUSTER_KEYS``;
    None when neither is set. Reads ``<side>.key_secret`` and the other side's ``.key``.

    Raises:
        ClusterKeysError: either file is missing or unreadable (the message names the files
            each side needs), or the directory holds only an earlier version's single key pair.
        ValueError: ``side`` is neither ``ROUTER`` nor ``MEMBER``.
    """
    if side not in _PEER:
        raise ValueError(f"side must be {ROUTER!r} or {MEMBER!r}, got {side!r}")
    directory = directory or os.environ.get(KEYS_ENV) or None
    if directory is None:
        return None
    d = Path(directory)
    peer = _PEER[side]
    need = (f"the router's process needs {ROUTER}.key_secret and {MEMBER}.key, every worker "
            f"{MEMBER}.key_secret and {ROUTER}.key")
    if not (d / f"{side}.key_secret").exists() and (d / f"{_LEGACY}.key_secret").exists():
        raise ClusterKeysError(f"{d} holds one shared key pair ({_LEGACY}.key_secret), which every member could use "
                               f"to command every worker: write a router pair and a member pair with `epd keys "
                               f"generate --force {d}` ({need})")
    try:
        public, secret = zmq.auth.load_certificate(str(d / f"{side}.key_secret"))
        peer_public, _ = zmq.auth.load_certificate(str(d / f"{peer}.key"))
    except (OSError, ValueError) as e:
        raise ClusterKeysError(f"cannot read the {side} keys in {d} ({e}): create them with "
                               f"`epd keys generate DIR` ({need})") from None
    if not secret:
        raise ClusterKeysError(f"{d / f'{side}.key_secret'} holds no secret key: copy the file written by "
                               "`epd keys generate`")
    return ClusterKeys(side, public, secret, peer_public, d)


def is_loopback(host: str) -> bool:
    """``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_keys(host: str, keys: ClusterKeys | None, what: str, flag: str) -> None:
    """Refuse to bind ``what`` on a non-loopback ``host`` without cluster keys.

    Raises:
        ClusterKeysError: naming the fix (``epd keys generate``, ``--cluster-keys``).
    """
    if keys is None and not is_loopback(host):
        raise ClusterKeysError(
            f"refusing to bind the {what} on {host} ({flag}) without authentication: any host that reaches it "
            f"could join the cluster. Create keys with `epd keys generate DIR` and pass --cluster-keys DIR "
            f"(or set ${KEYS_ENV}) to every epd process, or bind 127.0.0.1")
