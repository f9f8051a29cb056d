"""A worker's own HTTP endpoint (``epd worker --http-port``): probes and metrics.

- ``GET /health``: 200 while the router has this worker registered and it is not
  draining (a Kubernetes readiness probe: the worker takes traffic), else 503;
- ``GET /live``: 200 while the process runs its heartbeat thread and its main loop
  has begun an iteration within ``--stall-timeout`` (a liveness probe: a long engine
  step is not a hang, a loop wedged longer than that is), else 503;
- ``GET /metrics``: this worker's Prometheus series (``epd.metrics``), for a
  PodMonitor when the worker runs on another host than the API.

Served by the standard library's threading HTTP server on a daemon thread, bound
to the worker's advertised address. It exposes no control: nothing it receives
reaches the worker loop. Each connection is served by a thread of its own, so their
number is bounded: at most ``MAX_CONNECTIONS`` at once (one more is answered 503 and
closed at once), and one that has not sent its request within ``REQUEST_TIMEOUT_S``
is closed, so idle connections hold no thread for long and a probe gets through.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["HealthServer", "MAX_CONNECTIONS", "REQUEST_TIMEOUT_S"]

#: connections served at once (a thread each); more are answered 503 and closed
MAX_CONNECTIONS = 16
#: seconds a connection may take to send its request, and each read or write after it
REQUEST_TIMEOUT_S = 5.0
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class HealthServer:
    """Serves ``/health``, ``/live`` and ``/metrics`` for ``worker`` on ``host:port``.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, worker, host: str, port: int) -> None:
        self.worker = worker

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # the socket's timeout: an idle or slow client is dropped

            def do_GET(self) -> None:  # http.server's name
                w = outer.worker
                if self.path == "/metrics":
                    from epd.metrics import render_latest

                    body, ctype = render_latest()
                    return self._reply(200, body, ctype)
                if self.path == "/live":
                    beating = w._beat_thread is not None and w._beat_thread.is_alive()
                    stalled = w.loop_stalled()
                    alive = beating and not stalled
                    return self._json(200 if alive else 503, {"live": alive, "loop_stalled": stalled})
                if self.path == "/health":
                    ready = w.registered and not w.draining and w.running
                    return self._json(200 if ready else 503, {
                        "instance_id": w.instance_id, "role": str(w.role), "registered": w.registered,
                        "draining": w.draining})
                self._json(404, {"error": f"no such path {self.path}"})

            def _json(self, status: int, obj) -> None:
                self._reply(status, json.dumps(obj).encode(), "application/json")

            def _reply(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # probes every few seconds: no log line each
                pass

        outer = self
        bare = host.strip("[]")

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in bare else socket.AF_INET
            daemon_threads = True
            slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

            def process_request(self, request, client_address) -> None:
                if not self.slots.acquire(blocking=False):  # all threads busy: answer now, hold nothing
                    request.setblocking(False)
                    try:
                        request.send(_BUSY)
                    except OSError:
                        pass
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    self.slots.release()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    self.slots.release()

        try:
            self.server = Server((bare, port), Handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve --http-port {port} on {bare}: {e.strerror}") from None
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="epd-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
