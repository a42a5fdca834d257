"""``chunk_above`` per request: the OpenAI and TEI request models carry it into the policy the
replica plans with; it only means something in chunk mode (elsewhere a 400 naming it)."""

from __future__ import annotations

import pytest

from embedfleet.deployments.ingress.openai import parse_embedding_request, to_pipeline
from embedfleet.deployments.ingress.tei import parse_tei_embed_request, tei_to_pipeline
from embedfleet.deployments.common.errors import InvalidParameterValue, RequestValidation
from embedfleet.deployments.common.long_input import LongInputPolicy, SpecialTokens, plan
from embedfleet.deployments.ingress.pipeline import request_policy

MODEL = LongInputPolicy(mode="chunk", chunk_tokens=64, chunk_overlap=8)


def _openai(body: dict, default: LongInputPolicy = MODEL) -> LongInputPolicy:
    req = to_pipeline(parse_embedding_request({"model": "m", "input": "a", **body}))
    return request_policy(default, req) or default


def _tei(body: dict, default: LongInputPolicy = MODEL) -> LongInputPolicy:
    req = tei_to_pipeline(parse_tei_embed_request({"inputs": "a", **body}), "m")
    return request_policy(default, req) or default


@pytest.mark.parametrize("policy", [_openai, _tei])
def test_a_request_chooses_chunk_above_over_the_models_default(policy):
    assert policy({}).chunk_above == "max_model_len"
    chosen = policy({"chunk_above": "always"})
    assert chosen.chunk_above == "always"
    assert (chosen.mode, chosen.chunk_tokens, chosen.chunk_overlap) == ("chunk", 64, 8)
    back = policy({"chunk_above": "max_model_len"}, MODEL.model_copy(update={"chunk_above":
                                                                              "always"}))
    assert back.chunk_above == "max_model_len"
    # ...and the replica then splits an input that fits the model but not one window.
    ids = [101, *range(1000, 1150), 102]
    special = SpecialTokens([101], [102])
    assert plan(ids, 256, policy({}), special).chunks == 1
    assert plan(ids, 256, chosen, special).chunks == 3


def test_openai_request_may_ask_for_chunk_mode_and_always_together():
    p = _openai({"long_input": "chunk", "chunk_above": "always"},
                LongInputPolicy(mode="reject", chunk_tokens=64, chunk_overlap=8))
    assert (p.mode, p.chunk_above) == ("chunk", "always")


@pytest.mark.parametrize("policy, body", [
    (_openai, {"long_input": "truncate", "chunk_above": "always"}),
    (_tei, {"truncate": False, "chunk_above": "always"}),
    (_tei, {"truncate": True, "chunk_above": "max_model_len"}),
])
def test_chunk_above_outside_chunk_mode_is_a_400_naming_it(policy, body):
    with pytest.raises(InvalidParameterValue, match="chunk_above applies to chunked") as e:
        policy(body)
    assert e.value.param == "chunk_above" and e.value.status == 400


def test_chunk_above_with_a_model_that_does_not_chunk_is_a_400():
    with pytest.raises(InvalidParameterValue, match="'reject'"):
        _openai({"chunk_above": "always"}, LongInputPolicy())


@pytest.mark.parametrize("parse, body", [
    (parse_embedding_request, {"model": "m", "input": "a", "chunk_above": "sometimes"}),
    (parse_tei_embed_request, {"inputs": "a", "chunk_above": 3}),
])
def test_an_unknown_chunk_above_is_a_422_naming_the_field(parse, body):
    with pytest.raises(RequestValidation) as e:
        parse(body)
    assert e.value.param == "chunk_above"
