"""Start and stop a local Prometheus process (the Debian package's binary).

Used by ``embedfleet up`` and by tests that need a real Prometheus: a real one is the only way to
know that scrape configs, recording rules and the governor's PromQL agree with each other.

Everything the process owns lives in one directory: the config (and any rule files next to it,
so relative ``rule_files`` entries resolve), the TSDB, the log and a pid file that ``embedfleet
down`` can use from another process.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

DEFAULT_BINARY = "/usr/bin/prometheus"
CONFIG_NAME = "prometheus.yml"
LOG_NAME = "prometheus.log"
PID_NAME = "prometheus.pid"


class PrometheusStartError(RuntimeError):
    """Prometheus is not installed, exited during start-up, or never became ready."""


def find_binary(binary: str | None = None) -> str:
    """The Prometheus executable: ``binary``, else ``prometheus`` on PATH, else Debian's path."""
    for candidate in (binary, shutil.which("prometheus"), DEFAULT_BINARY):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PrometheusStartError("no prometheus binary found; install the Debian package "
                               "`prometheus` (`make setup` does) or pass its path")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Prometheus cannot report a port it chose itself; if
    another process takes this one first, start-up fails loudly (the log says 'address in use')."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # PR_SET_PDEATHSIG(SIGTERM): if the parent is killed outright (a test run hitting a hard
    # timeout), Prometheus does not outlive it holding the port and the TSDB lock.
    # Caveat: the signal fires when the parent *thread* exits, so only use from a long-lived one.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)


@dataclass
class PrometheusHandle:
    """A running Prometheus. ``stop()`` is idempotent; the handle is a context manager."""

    process: subprocess.Popen
    url: str
    port: int
    data_dir: Path
    log_path: Path
    _log_file: object = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def reload(self) -> None:
        """Re-read the config and rule files (SIGHUP, as Prometheus documents)."""
        self.process.send_signal(signal.SIGHUP)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Prometheus flushes its head block), then SIGKILL after ``timeout``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        (self.data_dir / PID_NAME).unlink(missing_ok=True)

    def __enter__(self) -> PrometheusHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_prometheus(config_text: str, data_dir: str | os.PathLike, port: int, *,
                     host: str = "127.0.0.1", files: Mapping[str, str] | None = None,
                     binary: str | None = None, ready_timeout: float = 30.0,
                     extra_args: Sequence[str] = (), detach: bool = False) -> PrometheusHandle:
    """Write ``config_text`` (and ``files``, e.g. rule files, by name) into ``data_dir``, start
    Prometheus on ``host:port`` and return once ``/-/ready`` answers 200.

    ``detach=True`` puts it in its own session so it outlives this process (``embedfleet up``
    returning while the cluster keeps running); otherwise it dies with its parent.
    Raises ``PrometheusStartError`` with the log's tail if it exits or is not ready in time.
    """
    exe = find_binary(binary)
    root = Path(data_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    config_path = root / CONFIG_NAME
    config_path.write_text(config_text)
    log_path = root / LOG_NAME
    log_file = open(log_path, "ab")  # a file, not a pipe: a full pipe would block Prometheus
    cmd = [exe, f"--config.file={config_path}", f"--storage.tsdb.path={root / 'tsdb'}",
           f"--web.listen-address={host}:{port}",
           # /-/reload and /-/quit over HTTP, for `embedfleet` commands run from another process.
           "--web.enable-lifecycle", *extra_args]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                               stderr=subprocess.STDOUT, start_new_session=detach,
                               preexec_fn=None if detach else _die_with_parent)
    url_host = f"[{host}]" if ":" in host else host
    handle = PrometheusHandle(process=process, url=f"http://{url_host}:{port}", port=port,
                              data_dir=root, log_path=log_path, _log_file=log_file)
    (root / PID_NAME).write_text(f"{process.pid}\n")
    try:
        _wait_ready(handle, ready_timeout)
    except BaseException:
        handle.stop()
        raise
    return handle


def _wait_ready(handle: PrometheusHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if not handle.running():
                raise PrometheusStartError(
                    f"prometheus exited with code {handle.process.returncode} during start-up; "
                    f"log {handle.log_path}:\n{handle.log_tail()}")
            try:
                resp = client.get(f"{handle.url}/-/ready")
                if resp.status_code == 200:
                    return
                last_error = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last_error = repr(exc)
            time.sleep(0.1)
    raise PrometheusStartError(f"prometheus not ready at {handle.url} after {timeout:g} s "
                               f"({last_error}); log {handle.log_path}:\n{handle.log_tail()}")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (exited, waiting for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # state follows "(comm)"; comm may hold ")"


def _ours(pid: int, root: Path) -> bool:
    """A prometheus process using ``root``'s TSDB (so never an unrelated reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (any(os.path.basename(a) == b"prometheus" for a in cmdline[:1])
            and f"--storage.tsdb.path={root / 'tsdb'}".encode() in cmdline)


def _find_ours(root: Path) -> int | None:
    """The pid of a Prometheus on ``root`` whose pid file is gone: a failed second start (port
    taken by the first) removes the file the first one wrote."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ours(int(entry), root) and _alive(int(entry)):
            return int(entry)
    return None


def stop_from_pidfile(data_dir: str | os.PathLike, timeout: float = 10.0) -> bool:
    """Stop a Prometheus started (detached) by another process with this ``data_dir``.

    Returns False when none is running. A pid is only signalled if its command line is a
    prometheus using this data dir: a stale pid file must not kill an unrelated process that
    reused the number. Without a (valid) pid file, the process is found by that command line.
    """
    root = Path(data_dir).resolve()
    pid_path = root / PID_NAME
    try:
        pid: int | None = int(pid_path.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is None or not _ours(pid, root):
        pid = _find_ours(root)
    if pid is None:
        pid_path.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    pid_path.unlink(missing_ok=True)
    return True
