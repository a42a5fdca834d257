"""The shared half of embedfleet's STAND-IN exporters — FOR TESTS AND DEMOS ONLY.

``standin_npu_exporter`` (Huawei's npu-exporter's HBM series) and ``standin_ray_agent`` (the
replica's card series as Ray's metrics agent exports them) serve only values a test set. What
they share lives here: a store of cards keyed by ``(node, device)``, the Prometheus text-format
label escaping, and a small threaded HTTP server (``GET /metrics``, ``GET /cards``, ``GET /``
for the module's docstring, ``POST /remove``, and each stand-in's own ``POST`` routes).
A subclass says what a card is (``render`` and its setters) and which ``POST`` routes it adds.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

CardT = TypeVar("CardT")


def label(value: str) -> str:
    """Text-format escaping of a label value: backslash, double quote, newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def info_lines(name: str, banner: str, what: str) -> list[str]:
    """The series that says, in every scrape, that a stand-in served it."""
    return [f"# HELP {name} {banner}: {what}.", f"# TYPE {name} gauge",
            f'{name}{{warning="{banner}"}} 1']


class StandinExporter(Generic[CardT]):
    """A stand-in exporter as an object: ``start()`` serves in a daemon thread, a subclass's
    setters change values. Use as a context manager in tests; ``port=0`` picks a free port
    (see ``.port``/``.url``)."""

    thread_name = "standin-exporter"
    about = ""  # served at GET /: the subclass module's docstring

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._cards: dict[tuple[str, str], CardT] = {}
        self._server = ThreadingHTTPServer((host, port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # --- values ---------------------------------------------------------------------------------
    def render(self, cards: list[CardT]) -> str:
        raise NotImplementedError

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """A subclass's ``POST`` route: the JSON answer, or ``None`` for no such route. A caller's
        mistake raises ``KeyError``, ``TypeError`` or ``ValueError`` (a 400 naming it)."""
        if path == "/remove":
            return {"removed": self.remove(body.get("node"), body.get("device"))}
        return None

    def remove(self, node: str | None = None, device: str | int | None = None) -> int:
        """Drop matching cards (all when both are None); returns how many went."""
        with self._lock:
            gone = [k for k in self._cards
                    if (node is None or k[0] == node) and (device is None or k[1] == str(device))]
            for k in gone:
                del self._cards[k]
        return len(gone)

    def cards(self) -> list[CardT]:
        with self._lock:
            return [self._cards[k] for k in sorted(self._cards)]

    def metrics_text(self) -> str:
        return self.render(self.cards())

    # --- server ---------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}"

    def start(self):  # -> the subclass
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name=self.thread_name)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    def __enter__(self):  # -> the subclass
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _make_handler(exporter: StandinExporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # a scrape per second would flood stderr
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, exporter.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/cards":
                self._send(200, json.dumps([asdict(c) for c in exporter.cards()]))
            elif path == "/":
                self._send(200, exporter.about, "text/plain; charset=utf-8")
            else:
                self._send(404, json.dumps({"error": f"no route {path}"}))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                length = int(self.headers.get("Content-Length") or 0)
                answer = exporter.post(path, json.loads(self.rfile.read(length) or b"{}"))
            except (KeyError, TypeError, ValueError) as exc:  # the caller's mistake: say which
                self._send(400, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
                return
            if answer is None:
                self._send(404, json.dumps({"error": f"no route {path}"}))
            else:
                self._send(200, json.dumps(answer))

    return Handler
