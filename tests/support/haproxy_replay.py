"""Serve's own HAProxy config, rendered for two stand-in Router replicas, and a fault injector;
and what every test that runs the real HAProxy binary needs (a free port, the binary up).

``render_serve_haproxy`` runs Ray's HAProxy config generator (``HAProxyApi``, the code Serve's
HAProxyManager runs) in a child process whose environment is the one given, because Ray reads
its ``RAY_SERVE_HAPROXY_*`` settings once, at import. The backend is one app with two servers,
as Serve renders a Router deployment with two replicas.

``StandinRouter`` is an HTTP server in a thread, in place of a Router replica: it answers
HAProxy's health checks, and answers POSTs with its own name until ``die()``. From then on it
is a **fault injector**: it reads each request whole and closes the connection without a
byte of answer, as a Router process killed with the request in hand does (the kernel closes its
sockets), and it refuses new connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

_RENDER = r"""
import json, sys
from ray.serve.config import HTTPOptions
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
a = json.loads(sys.argv[1])
cfg = HAProxyConfig(socket_path=a["dir"] + "/admin.sock", server_state_base=a["dir"],
                    server_state_file=a["dir"] + "/server-state", metrics_enabled=False,
                    stats_port=a["stats_port"], metrics_port=a["metrics_port"], log_target="stderr",
                    http_options=HTTPOptions(host="127.0.0.1", port=a["port"]),
                    has_received_routes=True, has_received_servers=True)
servers = [ServerConfig(name=n, host="127.0.0.1", port=p) for n, p in a["servers"]]
backend = BackendConfig(name="http-app", path_prefix="/", app_name="app", servers=servers)
api = HAProxyApi(cfg, {"app": backend}, config_file_path=a["dir"] + "/haproxy.cfg")
api._generate_config_file_internal()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_on(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` on this machine (/proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        addr, p = fields[1].split(":")
        if fields[3] == "0A" and int(p, 16) == port:  # 0A: LISTEN
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def start_haproxy(binary: Path, cfg: Path, port: int) -> subprocess.Popen:
    """The HAProxy binary on ``cfg``, once it listens on ``port`` (it fails fast if it exits)."""
    proc = subprocess.Popen([str(binary), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert proc.poll() is None, f"haproxy exited {proc.returncode} with {cfg.read_text()}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("haproxy did not listen")


def render_serve_haproxy(folder: Path, env: dict[str, str], port: int,
                         servers: list[tuple[str, int]]) -> Path:
    """Serve's haproxy.cfg for `servers` behind 127.0.0.1:`port`, with Ray reading `env`."""
    args = {"dir": str(folder), "port": port, "servers": servers,
            "stats_port": free_port(), "metrics_port": free_port()}
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("RAY_SERVE_HAPROXY_")}
    subprocess.run([sys.executable, "-c", _RENDER, json.dumps(args)], env={**clean, **env},
                   check=True, timeout=120, capture_output=True)
    return folder / "haproxy.cfg"


class StandinRouter:
    """A stand-in Router replica's HTTP server (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = threading.Event()
        self.cut = 0  # requests read whole and dropped after die()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def die(self) -> None:
        """From now on: drop each request without an answer, and refuse new connections."""
        self.dead.set()
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionError):  # HAProxy may drop an idle one
            buf = b""
            while True:
                request, buf = _read_request(conn, buf)
                if request is None:
                    return
                if self.dead.is_set():
                    self.cut += 1
                    return  # the request was read whole; the connection closes unanswered
                body = self.name.encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def _read_request(conn: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
    """One whole HTTP/1.1 request (headers and a Content-Length body) off a kept-alive socket."""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]
