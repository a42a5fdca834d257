"""Optional bearer API keys for the router.

Keys come from a file (one per line, ``#`` comments) and/or the environment variable named in the
config (comma-separated), read once when the router starts. With no keys configured the API is
open. With keys, every route but ``/health`` needs ``Authorization: Bearer <key>``; keys are
compared in constant time (``hmac.compare_digest``) against every configured key, so timing says
nothing about which key or how much of it matched.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from embedfleet.deployments.errors import Unauthorized, error_response

OPEN_PATHS = frozenset({"/health"})


def load_api_keys(keys_file: str | None, keys_env: str | None) -> tuple[bytes, ...]:
    keys: list[str] = []
    if keys_file:
        for line in Path(keys_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    if keys_env and os.environ.get(keys_env):
        keys += [k.strip() for k in os.environ[keys_env].split(",") if k.strip()]
    return tuple(k.encode() for k in keys)


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key, always: no early exit that would leak which one matched.
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented, k)
    return ok


class ApiKeyMiddleware:
    """ASGI middleware; ``keys_provider`` is read per request (the router sets keys at start)."""

    def __init__(self, app: ASGIApp, keys_provider) -> None:
        self.app = app
        self.keys_provider = keys_provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys_provider()
        if scope["type"] != "http" or not keys or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token or not key_matches(token.strip(), keys):
            reason = "missing" if not header else "invalid"
            err = Unauthorized(f"{reason} API key: send 'Authorization: Bearer <key>'")
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)
