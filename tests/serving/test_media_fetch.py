"""MediaFetcher: allowlist, address checks on every redirect hop, size and time limits.

A real HTTP server on 127.0.0.1 serves the media. Loopback is exactly what the
fetcher must refuse, so the success and redirect cases name hosts through a
test resolver and treat 127.0.0.1 (only) as "public"; the default resolver and
address check are exercised by the refusal cases.
"""

from __future__ import annotations

import http.server
import io
import threading
import time

import pytest
from PIL import Image

from epd.api.media_fetch import MediaFetcher, is_public_address
from epd.encoders.media_limits import MediaError


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def origin():
    png = _png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path.startswith("/to/"):  # /to/<host>/<path>: redirect to that host, same port
                host, _, rest = self.path[4:].partition("/")
                self.send_response(302)
                self.send_header("Location", f"http://{host}:{self.server.server_port}/{rest}")
                self.end_headers()
            elif self.path == "/loop":
                self.send_response(302)
                self.send_header("Location", "/loop")
                self.end_headers()
            elif self.path == "/big":  # no Content-Length: the limit applies while reading
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"x" * 50_000)
            elif self.path == "/slow":
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                for _ in range(10):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)
            else:
                self.send_response(404)
                self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.handle_error = lambda request, address: None  # the fetcher hangs up on over-limit bodies
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, png
    server.shutdown()


def _fetcher(**kw) -> MediaFetcher:
    names = {"media.test": "127.0.0.1", "cdn.media.test": "127.0.0.1", "internal.test": "10.0.0.7"}

    def resolve(host, port):
        if host not in names:
            raise OSError("no such host")
        return [names[host]]

    return MediaFetcher(["media.test", "internal.test"], resolve=resolve,
                        allow_address=lambda ip: ip == "127.0.0.1" or is_public_address(ip), **kw)


def test_address_classes():
    assert is_public_address("8.8.8.8") and is_public_address("2606:4700:4700::1111")
    for ip in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "::1",
               "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "224.0.0.1", "240.0.0.1", "100.64.0.1"):
        assert not is_public_address(ip), ip


def test_allowlisted_host_is_fetched_and_subdomains_count(origin):
    port, png = origin
    f = _fetcher()
    assert f.fetch(f"http://media.test:{port}/img.png") == png
    assert f.fetch(f"http://cdn.media.test:{port}/img.png") == png
    # A redirect to another allowed host with a public address is followed.
    assert f.fetch(f"http://media.test:{port}/to/cdn.media.test/img.png") == png


def test_refusals(origin):
    port, _ = origin
    f = _fetcher()
    cases = {
        f"http://other.test:{port}/img.png": "not on this server's allowed media domains",
        f"http://notmedia.test:{port}/img.png": "not on this server's allowed media domains",
        f"http://internal.test:{port}/img.png": "private, loopback",
        # every redirect hop is checked: an allowed host redirecting to a private address
        f"http://media.test:{port}/to/internal.test/img.png": "private, loopback",
        # ... or to a host that is not allowed at all
        f"http://media.test:{port}/to/evil.test/img.png": "not on this server's allowed media domains",
        f"http://media.test:{port}/loop": "redirects",
        f"http://media.test:{port}/missing": "HTTP 404",
        f"ftp://media.test:{port}/img.png": "data:, http: or https:",
    }
    for url, message in cases.items():
        with pytest.raises(MediaError, match=message.replace("(", r"\(")):
            f.fetch(url)
    # The real resolver and address check: loopback is refused even when allowlisted.
    real = MediaFetcher(["localhost", "127.0.0.1"])
    for url in (f"http://localhost:{port}/img.png", f"http://127.0.0.1:{port}/img.png"):
        with pytest.raises(MediaError, match="private, loopback"):
            real.fetch(url)
    with pytest.raises(MediaError, match="allowed media domains"):
        MediaFetcher([]).fetch(f"http://localhost:{port}/img.png")  # empty allowlist: nothing is fetched


def test_size_and_time_limits(origin):
    port, png = origin
    with pytest.raises(MediaError, match="limit"):
        _fetcher(max_bytes=len(png) - 1).fetch(f"http://media.test:{port}/img.png")  # Content-Length over
    with pytest.raises(MediaError, match="limit"):
        _fetcher(max_bytes=10_000).fetch(f"http://media.test:{port}/big")  # body over, no Content-Length
    with pytest.raises(MediaError, match="longer than"):  # a body that drips in past the deadline
        _fetcher(timeout_s=0.5).fetch(f"http://media.test:{port}/slow")
