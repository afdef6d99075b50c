"""Serving families in the Prometheus text formats, as bytes or over HTTP.

``render`` is what any HTTP server calls (the front door mounts it at ``/metrics``);
``MetricsServer`` is a small threaded HTTP server for a process without one (the router's
``--metrics-port``). Both take a ``collect`` function that returns the families to show at
that moment, so the served view can be a merge of several processes.
"""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted

logger = logging.getLogger(__name__)

Collect = Callable[[], Iterable[Metric]]
PATHS = ("/metrics", "/metrics/")


class _View:
    """The ``registry`` that prometheus_client's encoders read: anything with collect()."""

    def __init__(self, collect: Collect) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def render(collect: Collect, accept: str | None = None) -> tuple[bytes, str]:
    """(body, content type) of the families ``collect()`` returns.

    ``accept`` is the request's Accept header: OpenMetrics when it asks for it, the
    classic text format (version 0.0.4) otherwise, as Prometheus negotiates.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_View(collect)), content_type


def render_snapshot(data: bytes, accept: str | None = None) -> tuple[bytes, str]:
    """(body, content type) of a ``MetricsSnapshot``'s families (the router's view of the
    deployment): what an HTTP front door answers on ``GET /metrics``.

    Raises:
        WireError: ``data`` is not a valid snapshot.
    """
    from common.metrics.wire import from_wire, loads

    families = from_wire(loads(data))
    return render(lambda: families, accept)


class MetricsServer:
    """HTTP ``GET /metrics`` on ``host:port`` (port 0: any free port) in daemon threads.

    Other paths answer 404, other methods 405. ``close()`` stops it.
    """

    def __init__(self, collect: Collect, host: str = "127.0.0.1", port: int = 0) -> None:
        self._collect = collect
        self._httpd = make_server(host, port, self._app, ThreadingWSGIServer,
                                  handler_class=_QuietHandler)
        self.host, self.port = host, self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="metrics-http", daemon=True)
        self._thread.start()
        logger.info("metrics: serving http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _app(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path not in PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"pdkv serves its metrics at /metrics\n"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b"use GET /metrics\n"]
        try:
            body, content_type = render(self._collect, environ.get("HTTP_ACCEPT"))
        except Exception:  # a scrape never takes the process down
            logger.exception("metrics: collecting failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"collecting metrics failed; see the process log\n"]
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [b"" if method == "HEAD" else body]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every few seconds: not log-worthy
        pass
