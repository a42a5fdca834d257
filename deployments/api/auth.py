"""Optional bearer API keys for the router.

Keys come from a file (one per line, ``#`` comments) and/or the environment variable named in the
config (comma-separated), read once when the router starts. With no keys configured the API is
open. With keys, every route but ``/health`` needs ``Authorization: Bearer <key>``; keys are
compared in constant time (``hmac.compare_digest``) against every configured key, so timing says
nothing about which key or how much of it matched.

A key in the file may be limited to one priority lane (``sk-indexer lane=bulk``): its requests
go to that lane by default, and asking for the other one is refused with 403. The middleware
puts the matched key's lane, if any, in the request's scope state (``LANE_LIMIT``).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from embedfleet.deployments.contracts import LANES, Lane
from embedfleet.deployments.errors import Unauthorized, error_response

OPEN_PATHS = frozenset({"/health"})
LANE_LIMIT = "embedfleet_lane_limit"  # scope["state"] key: the lane the matched key is limited to


def _key_lines(keys_file: str) -> list[tuple[str, Lane | None]]:
    """(key, lane limit) per line of the keys file: ``KEY`` or ``KEY lane=bulk``."""
    out: list[tuple[str, Lane | None]] = []
    for n, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        lane = None
        for opt in words[1:]:
            name, _, value = opt.partition("=")
            if name != "lane" or value not in LANES:
                raise ValueError(f"{keys_file}:{n}: expected 'KEY' or 'KEY lane=interactive|bulk',"
                                 f" got option {opt!r}")
            lane = value
        out.append((words[0], lane))
    return out


def load_key_lanes(keys_file: str | None) -> dict[bytes, Lane]:
    """The keys limited to one lane, from the keys file."""
    if not keys_file:
        return {}
    lanes: dict[bytes, Lane | None] = {}
    for k, lane in _key_lines(keys_file):
        if lanes.setdefault(k.encode(), lane) != lane:
            raise ValueError(f"{keys_file}: a key is listed twice with different lanes")
    return {k: lane for k, lane in lanes.items() if lane is not None}


def load_api_keys(keys_file: str | None, keys_env: str | None) -> tuple[bytes, ...]:
    keys: list[str] = [k for k, _ in _key_lines(keys_file)] if keys_file else []
    if keys_env and os.environ.get(keys_env):
        keys += [k.strip() for k in os.environ[keys_env].split(",") if k.strip()]
    return tuple(k.encode() for k in keys)


def _route_path(scope: Scope) -> str:
    """The path within the app: an app served under a route prefix (Serve's ``root_path``)
    still has its open routes open."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    return matched_key(presented, keys) is not None


def matched_key(presented: bytes, keys: tuple[bytes, ...]) -> bytes | None:
    # Compare against every key, always: no early exit that would leak which one matched.
    found = None
    for k in keys:
        if hmac.compare_digest(presented, k):
            found = k
    return found


class ApiKeyMiddleware:
    """ASGI middleware; ``keys_provider`` is read per request (the router sets keys at start)."""

    def __init__(self, app: ASGIApp, keys_provider, lanes_provider=dict) -> None:
        self.app = app
        self.keys_provider = keys_provider
        self.lanes_provider = lanes_provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys_provider()
        if scope["type"] != "http" or not keys or _route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        key = matched_key(token.strip(), keys) if scheme.lower() == b"bearer" and token else None
        if key is None:
            reason = "missing" if not header else "invalid"
            err = Unauthorized(f"{reason} API key: send 'Authorization: Bearer <key>'")
            await error_response(err)(scope, receive, send)
            return
        lane = self.lanes_provider().get(key)
        if lane is not None:
            scope.setdefault("state", {})[LANE_LIMIT] = lane
        await self.app(scope, receive, send)
