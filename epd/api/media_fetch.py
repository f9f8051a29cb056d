"""Fetch ``http(s)`` media URLs for the API, safely (SSRF guard).

Only hosts on an allowlist are fetched (``--allowed-media-domains``; empty by
default, so no URL is fetched). Each hop -- the first request and every
redirect, which are followed by hand -- resolves the host once, rejects it when
any resolved address is private, loopback, link-local, multicast, reserved or
unspecified, and then connects to exactly that checked address (so a second
DNS answer cannot swap in an internal one: no DNS-rebinding window). The body
is read under a byte limit and every hop under a wall-clock deadline.

Source: OWASP "Server-Side Request Forgery Prevention Cheat Sheet" (allowlist,
resolve-then-validate, no automatic redirects); vLLM's ``--allowed-media-domains``
names the same switch.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from epd.encoders.media_limits import MediaError

_REDIRECTS = (301, 302, 303, 307, 308)


def is_public_address(ip: str) -> bool:
    """True for a globally routable unicast address (IPv4 or IPv6, IPv4-mapped unwrapped)."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                or addr.is_reserved or addr.is_unspecified or not addr.is_global)


def _resolve(host: str, port: int) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


class _PinnedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, host: str, ip: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, ip: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._ip = ip

    def connect(self) -> None:
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class MediaFetcher:
    """Downloads media from allowlisted hosts.

    Args:
        allowed_domains: host names allowed (exact, or any subdomain of an entry);
            empty = every http(s) URL is refused.
        max_bytes: largest body accepted, bytes.
        timeout_s: deadline for the whole fetch (all hops), seconds.
        max_redirects: redirects followed at most.
        resolve / allow_address: DNS lookup ``(host, port) -> [ip, ...]`` and the
            address check (``is_public_address``); replaceable in tests only.

    ``fetch(url) -> bytes`` (blocking: call it in a thread) raises ``MediaError``
    with a message for the client for every refusal or failure.
    """

    def __init__(self, allowed_domains: list[str] | tuple[str, ...] = (), *, max_bytes: int = 20 * 2**20,
                 timeout_s: float = 10.0, max_redirects: int = 3,
                 resolve: Callable[[str, int], list[str]] = _resolve,
                 allow_address: Callable[[str], bool] = is_public_address) -> None:
        self.allowed = tuple(d.strip().lower().rstrip(".") for d in allowed_domains if d.strip())
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.resolve = resolve
        self.allow_address = allow_address

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed)

    def fetch(self, url: str, modality: str = "image") -> bytes:
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.max_redirects + 1):
            status, location, body = self._get(url, deadline, modality)
            if status in _REDIRECTS:
                if not location:
                    raise MediaError(f"{url} redirected without a Location header", modality=modality)
                url = urljoin(url, location)
                continue
            if status != 200:
                raise MediaError(f"fetching {url} returned HTTP {status}", modality=modality)
            return body
        raise MediaError(f"more than {self.max_redirects} redirects fetching the {modality} URL", modality=modality)

    def _get(self, url: str, deadline: float, modality: str) -> tuple[int, str | None, bytes]:
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MediaError(f"malformed {modality} URL", modality=modality) from None
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise MediaError(f"{modality} URLs must be data:, http: or https: URLs", modality=modality)
        if not self.host_allowed(host):
            raise MediaError(f"host {host!r} is not on this server's allowed media domains "
                             f"({', '.join(self.allowed) or 'none: send media as data: URLs'})", modality=modality)
        try:
            ips = self.resolve(host, port)
        except (OSError, UnicodeError):
            raise MediaError(f"cannot resolve host {host!r}", modality=modality) from None
        bad = [ip for ip in ips if not self.allow_address(ip)]
        if not ips or bad:
            raise MediaError(f"host {host!r} resolves to a private, loopback, link-local or reserved address; "
                             f"refused", modality=modality)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MediaError(f"fetching the {modality} URL took longer than {self.timeout_s} s", modality=modality)
        cls = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = cls(host, ips[0], port, remaining)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", path, headers={"User-Agent": "epd", "Accept": "*/*"})
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                return resp.status, resp.getheader("Location"), b""
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise MediaError(f"the {modality} at the URL is {length} bytes; the limit is {self.max_bytes}",
                                 modality=modality)
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = resp.read1(65536)
                if not chunk:
                    break
                total += len(chunk)
                if total > self.max_bytes:
                    raise MediaError(f"the {modality} at the URL is over the {self.max_bytes}-byte limit",
                                     modality=modality)
                chunks.append(chunk)
            return resp.status, None, b"".join(chunks)
        except TimeoutError:
            raise MediaError(f"fetching the {modality} URL took longer than {self.timeout_s} s",
                             modality=modality) from None
        except (OSError, http.client.HTTPException) as e:
            raise MediaError(f"fetching the {modality} URL failed: {type(e).__name__}", modality=modality) from None
        finally:
            conn.close()
