"""STAND-INS for a ``RequestPath``'s parts — for tests only (kept under tests/, never installed).

``request_path_over`` builds a real ``RequestPath`` whose own ``embed`` (runs, admission, engine
call, result) is under test, around stand-ins of what it is built with: the engine gate hands
out whatever ``next_engine()`` returns on each use, preparing a call gives ``pieces``, and
finishing it returns the engine's vectors as they are. The admission budget is the caller's,
usually the real ``AdmissionBudget``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import Fingerprint
from embedfleet.deployments.replica.request_path import RequestPath


def gate_of(next_engine: Callable[[], Any]) -> SimpleNamespace:
    """An engine gate that hands out ``next_engine()`` on each use (a swap: a different one)."""

    @contextlib.asynccontextmanager
    async def use(hold_s, retry_after_s):
        yield next_engine()

    return SimpleNamespace(use=use)


def request_path_over(next_engine: Callable[[], Any], budget: Any,
                      pieces: list[list[int]], *, max_tokens: int = 1 << 30,
                      large_call_tokens: int = 1 << 30) -> RequestPath:
    path = object.__new__(RequestPath)  # the path's own embed(), around stand-ins of its parts
    prepared = SimpleNamespace(pieces=pieces, piece_tokens=sum(map(len, pieces)),
                               input_tokens=sum(map(len, pieces)), report=lambda: ())
    path.__dict__.update(
        model="m", max_tokens=max_tokens, _large_call_tokens=large_call_tokens,
        queue=budget, _gate=gate_of(next_engine), _hold_s=1.0, _retry_after_s=1.0,
        _reads_cache=lambda: True, _replica_id="r", _rec=metrics.Batched(),
        _tag={"model": "m"}, _card_tag={"model": "m", "node": "n", "device": "0"},
        inflight_sequences=0, inflight_tokens=0, engine_failed=False,
        fingerprint=lambda: Fingerprint("d", "float32", "e", "cpu", False),
        preparer=SimpleNamespace(finish=lambda p, vecs, **kw: vecs, param="input"))

    async def prepare(call):
        return prepared

    path._prepare = prepare
    return path
