"""Bearer API keys for the HTTP ingress, and what each key may use.

Where the keys come from is the config's (``router.api_keys_file``, ``router.api_keys_env``):
naming a source makes keys required, and every ingress replica (the Router, or a one-model app's
engine replica) loads them itself when it starts (``load_keys``). A source it cannot read, or
one that holds no key, stops the replica from starting: an ingress that was meant to be closed
never serves open because one node lacks a file or a variable. With no source named the API is
open, which the config allows only on a loopback bind or with ``allow_unauthenticated``
(``config.router.open_bind_refusal``).

Keys file: one key per line, ``KEY [lane=interactive|bulk] [models=a,b]``; a line whose first
non-blank character is ``#`` is a comment. ``#`` anywhere else is part of the line (a key may
contain one), so a trailing "comment" is refused as an unknown option rather than silently cut.
Keys are compared in constant time (``hmac.compare_digest``) against every configured key, so
timing says nothing about which key or how much of it matched. Errors name lines, never keys.

A key may be limited to one priority lane (``lane=bulk``: its requests go to that lane by
default, asking for the other one is refused with 403) and to some models (``models=a,b``:
asking for another one is refused with 403). The middleware puts the matched key's limits in the
request's scope state (``LANE_LIMIT``, ``MODEL_LIMIT``); ``check_model_allowed`` is the check
the routes make once they know the model.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ..common.contracts import LANES, Lane
from ..common.errors import ModelNotAllowed, Unauthorized, clip, error_response

OPEN_PATHS = frozenset({"/health"})
LANE_LIMIT = "embedfleet_lane_limit"  # scope["state"] key: the lane the matched key is limited to
MODEL_LIMIT = "embedfleet_model_limit"  # scope["state"] key: the models the key may use
# A key is the only thing between the network and the cards. 16 characters of a random
# generator (`openssl rand -hex 16` gives 32) cannot be guessed online, while a short one such
# as a word or a name can; the bound also catches a truncated paste.
MIN_KEY_CHARS = 16
# Visible ASCII: what an Authorization header carries unchanged (no spaces, no controls).
_KEY_RE = re.compile(r"[\x21-\x7e]+")
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class KeysError(ValueError):
    """The configured keys cannot be used: the ingress replica must not start."""


@dataclass(frozen=True)
class KeyLimits:
    """What one key may use: a lane (None = either) and models (None = every model)."""

    lane: Lane | None = None
    models: frozenset[str] | None = None


@dataclass(frozen=True)
class ApiKeys:
    """The keys an ingress enforces (empty = open) and each key's limits."""

    keys: tuple[bytes, ...] = ()
    limits: dict[bytes, KeyLimits] | None = None

    def limits_of(self, key: bytes) -> KeyLimits:
        return (self.limits or {}).get(key, KeyLimits())

    def fingerprint(self) -> str:
        """A short digest of the key set, for logs: replicas whose logs show different ones
        enforce different keys (a node with a stale file), and it says nothing of any key."""
        digest = hashlib.sha256(b"\n".join(sorted(self.keys))).hexdigest()
        return f"sha256:{digest[:12]}"


def _check_key(key: str, where: str) -> None:
    if not _KEY_RE.fullmatch(key):
        raise KeysError(f"{where}: a key may hold only visible ASCII characters (no spaces)")
    if len(key) < MIN_KEY_CHARS:
        raise KeysError(f"{where}: a key of {len(key)} characters; at least {MIN_KEY_CHARS} are "
                        "required (e.g. `openssl rand -hex 24`)")


def _limits(options: list[str], where: str) -> KeyLimits:
    lane, models = None, None
    for opt in options:
        name, _, value = opt.partition("=")
        if name == "lane" and value in LANES and lane is None:
            lane = value
        elif name == "models" and models is None and value and all(
                _MODEL_RE.fullmatch(m) for m in value.split(",")):
            models = frozenset(value.split(","))
        else:
            hint = (" ('#' starts a comment only at the start of a line)"
                    if opt.startswith("#") else "")
            raise KeysError(f"{where}: expected 'KEY [lane=interactive|bulk] [models=a,b]', got "
                            f"option {clip(opt, 40)}{hint}")
    return KeyLimits(lane, models)  # type: ignore[arg-type]


def parse_keys_file(text: str, source: str) -> dict[str, KeyLimits]:
    """Key -> limits from a keys file's text; ``source`` names the file in errors."""
    out: dict[str, KeyLimits] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{source}:{n}"
        _check_key(words[0], where)
        limits = _limits(words[1:], where)
        if out.setdefault(words[0], limits) != limits:
            raise KeysError(f"{where}: a key listed twice with different limits")
    if not out:
        raise KeysError(f"{source} holds no API key (only comments or blank lines): a keys file "
                        "that names no key would leave the API open")
    return out


def read_keys_file(path: str) -> dict[str, KeyLimits]:
    full = Path(path).expanduser()
    try:
        text = full.read_text()
    except OSError as err:
        raise KeysError(f"router.api_keys_file {path}: cannot read it on this node "
                        f"({type(err).__name__}: {err.strerror or err})") from None
    except UnicodeDecodeError:  # a reload must refuse it like a bad line, never raise a 500
        raise KeysError(f"router.api_keys_file {path}: not UTF-8 text") from None
    return parse_keys_file(text, path)


def read_keys_env(name: str, environ: Any = None) -> list[str]:
    value = (os.environ if environ is None else environ).get(name, "")
    keys = [k.strip() for k in value.split(",") if k.strip()]
    if not keys:
        raise KeysError(f"router.api_keys_env {name}: unset or empty in this ingress replica's "
                        "environment")
    for i, k in enumerate(keys, 1):
        _check_key(k, f"{name} (key {i})")
    return keys


def load_keys(keys_file: str | None, keys_env: str | None, models: Any = None,
              environ: Any = None) -> ApiKeys:
    """The keys an ingress replica enforces, from every source the config names; raises
    ``KeysError`` (the replica must not start) when a named source gives none. ``models``: the
    config's model names, which every ``models=`` limit must name."""
    table: dict[str, KeyLimits] = read_keys_file(keys_file) if keys_file else {}
    for k in read_keys_env(keys_env, environ) if keys_env else []:
        table.setdefault(k, KeyLimits())
    if models is not None:
        known = set(models)
        for limits in table.values():
            if limits.models and (unknown := sorted(limits.models - known)):
                raise KeysError(f"router.api_keys_file {keys_file}: models= names "
                                f"{', '.join(map(repr, unknown))}, not served by this app "
                                f"({', '.join(sorted(known))})")
    return ApiKeys(tuple(k.encode() for k in table),
                   {k.encode(): v for k, v in table.items() if v != KeyLimits()})


class KeyRing:
    """The keys an ingress enforces, re-read when the keys file changes: rotation without a
    restart (add the new key, move clients, remove the old one). A Kubernetes Secret volume is
    updated in place by the kubelet, so the same holds on KubeRay.

    ``current()`` looks at the file at most every ``recheck_s`` (one ``stat``; a request never
    waits for more). A changed file that no longer parses, or holds no key, is refused like at
    start, but the replica keeps the keys it has: a typo never opens the API nor locks everyone
    out. The first load (``__init__``) raises ``KeysError``: a replica without keys never starts.
    """

    def __init__(self, keys_file: str | None, keys_env: str | None, models: Any = None,
                 recheck_s: float = 5.0, clock=None, log=None) -> None:
        import time

        self._file, self._env, self._models = keys_file, keys_env, models
        self._recheck_s, self._clock = recheck_s, clock or time.monotonic
        self._log = log
        self._stamp = self._file_stamp()
        self.keys = load_keys(keys_file, keys_env, models)
        self._next = self._clock() + recheck_s

    def _file_stamp(self) -> tuple | None:
        if not self._file:
            return None
        try:
            st = Path(self._file).expanduser().stat()  # follows the Secret volume's symlinks
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> ApiKeys:
        now = self._clock()
        if self._file and now >= self._next:
            self._next = now + self._recheck_s
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.keys = load_keys(self._file, self._env, self._models)
                    if self._log:
                        self._log.warning("API keys reloaded from %s (%d keys, %s)",
                                          self._file, len(self.keys.keys),
                                          self.keys.fingerprint())
                except KeysError as err:
                    if self._log:
                        self._log.error("API keys file changed but cannot be used; keeping the "
                                        "%d keys loaded before: %s", len(self.keys.keys), err)
        return self.keys


# -- the older per-field readers (tests and tools use them) -------------------------------------

def load_api_keys(keys_file: str | None, keys_env: str | None) -> tuple[bytes, ...]:
    return load_keys(keys_file, keys_env).keys


def load_key_lanes(keys_file: str | None) -> dict[bytes, Lane]:
    """The keys limited to one lane, from the keys file."""
    if not keys_file:
        return {}
    return {k.encode(): v.lane for k, v in read_keys_file(keys_file).items()
            if v.lane is not None}


def load_key_models(keys_file: str | None) -> dict[bytes, frozenset[str]]:
    """The keys limited to some models, from the keys file."""
    if not keys_file:
        return {}
    return {k.encode(): v.models for k, v in read_keys_file(keys_file).items()
            if v.models is not None}


def allowed_models(state: Any) -> frozenset[str] | set[str] | None:
    """The models the request's key is limited to, or None (any). ``state``: the request's
    ``request.state`` (or its scope's state dict)."""
    return (state.get(MODEL_LIMIT) if isinstance(state, dict)
            else getattr(state, MODEL_LIMIT, None))


def check_model_allowed(state: Any, model: str) -> None:
    """403 (``ModelNotAllowed``) when the request's key is limited to other models."""
    allowed = allowed_models(state)
    if allowed is not None and model not in allowed:
        raise ModelNotAllowed(f"this API key may not use model {clip(model, 64)}; it may use "
                              f"{', '.join(sorted(allowed))}", param="model")


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
    """ASGI middleware; the providers are read per request (the ingress sets keys at start)."""

    def __init__(self, app: ASGIApp, keys_provider, lanes_provider=dict,
                 models_provider=dict) -> None:
        self.app = app
        self.keys_provider = keys_provider
        self.lanes_provider = lanes_provider
        self.models_provider = models_provider

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
        models = self.models_provider().get(key)
        if models is not None:
            scope.setdefault("state", {})[MODEL_LIMIT] = models
        await self.app(scope, receive, send)
