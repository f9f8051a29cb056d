"""The cluster's keys: CURVE authentication and encryption of every ZeroMQ socket.

Every epd process of one deployment (``epd serve``, each ``epd worker``) holds the
same CURVE key pair, written by ``epd keys generate DIR`` as ``DIR/cluster.key``
(public) and ``DIR/cluster.key_secret`` (public + secret), the certificate files
of ``zmq.auth`` (pyzmq). Holding the secret is membership:

- a socket that **binds** (the router's inbox, a worker's command socket) is a
  CURVE server with a ZAP handler (``zmq.auth``'s authenticator) that admits only
  clients presenting a public key found in ``DIR`` (``*.key``), with
  ``ZAP_ENFORCE_DOMAIN`` on, so no handler means no connection (fail closed);
- a socket that **connects** is a CURVE client with the cluster key pair and the
  cluster public key as the server's key.

A peer without the secret never completes the handshake, so none of its bytes
reach a message decoder, let alone router or worker logic. Without keys a process
may bind loopback only (:func:`require_keys`): any local user could otherwise join.

Reference: ZeroMQ RFC 26 (CurveZMQ) and RFC 27 (ZAP); pyzmq's ``zmq.auth``.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

__all__ = ["ClusterKeys", "ClusterKeysError", "generate_keys", "is_loopback", "load_keys", "require_keys",
           "KEYS_ENV", "ZAP_DOMAIN"]

#: environment variable naming the keys directory when ``--cluster-keys`` is not given
KEYS_ENV = "EPD_CLUSTER_KEYS"
ZAP_DOMAIN = "epd"
_NAME = "cluster"


class ClusterKeysError(ValueError):
    """The keys are missing or unreadable, or a bind needs keys that were not given."""


@dataclass(frozen=True)
class ClusterKeys:
    """One cluster's CURVE key pair (Z85-encoded, 40 bytes each) and where it lives.

    ``directory`` also holds the public keys the ZAP handler admits (``*.key``).
    """

    public: bytes
    secret: bytes
    directory: Path

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that only ZAP-admitted clients reach."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of a cluster server."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public

    def start_authenticator(self, ctx: zmq.Context):
        """Start the ZAP handler of ``ctx`` (a ``zmq.Context`` or ``zmq.asyncio.Context``:
        the handler thread shares its libzmq context, as ZAP's inproc endpoint requires).
        Returns it; call ``.stop()`` before terminating the context."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.directory))
        return auth


def generate_keys(directory: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a new cluster key pair into ``directory`` (created, mode 0700): ``cluster.key``
    and ``cluster.key_secret`` (mode 0600). Returns the secret file's path.

    Raises:
        ClusterKeysError: keys already exist there and ``force`` is False.
    """
    d = Path(directory)
    secret_file = d / f"{_NAME}.key_secret"
    if secret_file.exists() and not force:
        raise ClusterKeysError(f"{secret_file} exists: keep using those keys, or pass --force to replace them "
                               "(every process of the cluster then needs the new ones)")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _, secret = zmq.auth.create_certificates(str(d), _NAME)
    os.chmod(secret, 0o600)
    return Path(secret)


def load_keys(directory: str | os.PathLike | None) -> ClusterKeys | None:
    """The keys in ``directory``, else in ``$EPD_CLUSTER_KEYS``; None when neither is set.

    Raises:
        ClusterKeysError: the directory has no readable ``cluster.key_secret``.
    """
    directory = directory or os.environ.get(KEYS_ENV) or None
    if directory is None:
        return None
    d = Path(directory)
    secret_file = d / f"{_NAME}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(str(secret_file))
    except (OSError, ValueError) as e:
        raise ClusterKeysError(f"cannot read the cluster keys in {d} ({e}): create them with "
                               f"`epd keys generate {d}` and give every process the same directory") from None
    if not secret:
        raise ClusterKeysError(f"{secret_file} holds no secret key: copy the whole directory written by "
                               "`epd keys generate`")
    return ClusterKeys(public, secret, d)


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
