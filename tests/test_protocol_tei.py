"""TEI-compatible /embed and /tokenize: request parsing, policy mapping, response shapes."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from embedfleet.deployments.common.errors import RequestValidation
from embedfleet.deployments.common.long_input import LongInputPolicy
from embedfleet.deployments.ingress.pipeline import request_policy
from embedfleet.deployments.replica.tokenize import TokenizeQueue, simple_tokens
from embedfleet.deployments.ingress.tei import (
    tei_to_pipeline,
    parse_tei_embed_request,
    parse_tei_tokenize_request,
    tei_embed_response,
    tei_tokenize_response,
)


# -- /embed request ----------------------------------------------------------------------------
def test_tei_client_defaults():
    req = parse_tei_embed_request({"inputs": "What is Deep Learning?"})
    assert req.inputs == ["What is Deep Learning?"]
    assert req.truncate is None and req.truncation_direction == "right"
    assert req.normalize is True and req.dimensions is None and req.prompt_name is None
    assert req.model is None


def test_full_tei_request_with_tei_capitalisation():
    req = parse_tei_embed_request({
        "inputs": ["a", "b"], "truncate": True, "truncation_direction": "Left",
        "normalize": False, "dimensions": 128, "prompt_name": "query"})
    assert req.inputs == ["a", "b"] and req.truncate is True
    assert req.truncation_direction == "left" and req.normalize is False
    assert req.dimensions == 128 and req.prompt_name == "query"
    assert parse_tei_embed_request({"inputs": "a", "truncation_direction": "right"}
                                   ).truncation_direction == "right"


@pytest.mark.parametrize("body,param,fragment", [
    ({"inputs": []}, "inputs", "empty list"),
    ({"inputs": ""}, "inputs", "empty string"),
    ({"inputs": ["ok", ""]}, "inputs", "inputs[1]"),
    ({"inputs": [1, 2, 3]}, "inputs", "/v1/embeddings"),
    ({"inputs": [["x"]]}, "inputs", "inputs[0]"),
    ({"inputs": 5}, "inputs", "string or a list"),
    ({}, "inputs", "required"),
    ({"inputs": "a", "truncation_direction": "Up"}, "truncation_direction", "Up"),
    ({"inputs": "a", "truncate": "yes please"}, "truncate", "truncate"),
    ({"inputs": "a", "dimensions": 0}, "dimensions", "dimensions"),
    ({"inputs": "a", "normalise": True}, "normalise", "unrecognized"),
])
def test_validation_errors_name_the_parameter(body, param, fragment):
    with pytest.raises(RequestValidation) as err:
        parse_tei_embed_request(body)
    assert err.value.param == param and err.value.status == 422
    assert fragment in err.value.message


def test_body_must_be_an_object():
    with pytest.raises(RequestValidation, match="JSON object"):
        parse_tei_embed_request(["a"])
    with pytest.raises(RequestValidation, match="JSON object"):
        parse_tei_tokenize_request("a")


@pytest.mark.parametrize("parse, fields", [
    (parse_tei_embed_request, ["inputs", "truncate", "truncation_direction", "normalize",
                               "dimensions", "prompt_name", "model", "lane"]),
    (parse_tei_tokenize_request, ["inputs", "add_special_tokens", "prompt_name", "model"]),
])
@pytest.mark.parametrize("depth", [255, 300, 800, 1024])
def test_a_value_nested_past_orjsons_encoder_is_a_422_with_a_short_echo(parse, fields, depth):
    # orjson parses 1,024 levels but encodes 254: echoing the value through it was a 500
    value = []
    for _ in range(depth - 1):
        value = [value]
    for field in fields:
        with pytest.raises(RequestValidation) as err:
            parse({"inputs": "a", field: value})
        assert err.value.param == field and len(err.value.message) < 200


def test_truncate_maps_onto_the_long_input_policy():
    default = LongInputPolicy(mode="chunk", chunk_tokens=400, chunk_overlap=50,
                              max_total_tokens=32768, truncation_direction="right")

    def policy(body, base=default):
        return request_policy(base, tei_to_pipeline(parse_tei_embed_request(body), "m")) or base

    assert policy({"inputs": "a"}) == default
    t = policy({"inputs": "a", "truncate": True, "truncation_direction": "Left"})
    assert (t.mode, t.truncation_direction) == ("truncate", "left")
    assert (t.chunk_tokens, t.chunk_overlap, t.max_total_tokens) == (400, 50, 32768)
    r = policy({"inputs": "a", "truncate": False})
    assert r.mode == "reject" and r.max_total_tokens == 32768
    # A direction alone refines the model's default (which may itself truncate).
    assert policy({"inputs": "a", "truncation_direction": "left"},
                  default.model_copy(update={"mode": "truncate"})).truncation_direction == "left"
    # An unspecified direction does not override a model default of "left".
    left_default = default.model_copy(update={"mode": "truncate", "truncation_direction": "left"})
    assert policy({"inputs": "a", "truncate": True}, left_default).truncation_direction == "left"


# -- /embed response ---------------------------------------------------------------------------
def test_embed_response_is_a_bare_list_of_float_lists():
    vecs = [np.array([0.1, 0.2, 0.3], np.float32), np.array([1.0, 0.0, -0.5], np.float32)]
    body = orjson.loads(tei_embed_response(vecs))
    assert isinstance(body, list) and len(body) == 2
    assert all(isinstance(v, list) and all(isinstance(x, float) for x in v) for v in body)
    np.testing.assert_allclose(body, np.stack(vecs), rtol=1e-6)


def test_tokenize_request_defaults():
    req = parse_tei_tokenize_request({"inputs": "test"})
    assert req.inputs == ["test"] and req.add_special_tokens is True and req.prompt_name is None
    with pytest.raises(RequestValidation) as err:
        parse_tei_tokenize_request({"inputs": "a", "add_special": False})
    assert err.value.param == "add_special"


def tokenize_tei(tokenizer, texts, add_special_tokens=True):
    """What the replica answers ``/tokenize`` with (its queue runs the tokenizer in a thread)."""
    q = TokenizeQueue(model="m", max_inputs=64, max_chars=1 << 20, max_tokens=1 << 20,
                      queue_timeout_s=5.0)
    return asyncio.run(q.tokenize(tokenizer, texts, add_special_tokens))


def test_tokenize_matches_the_model_tokenizer(minilm_tokenizer):
    texts = ["Hello, world!", "Café naïve — 東京"]
    out = orjson.loads(tei_tokenize_response(tokenize_tei(minilm_tokenizer, texts)))
    assert len(out) == 2
    for text, toks in zip(texts, out):
        assert all(set(t) == {"id", "text", "special", "start", "stop"} for t in toks)
        assert [t["id"] for t in toks] == minilm_tokenizer(text)["input_ids"]
        first, last = toks[0], toks[-1]
        assert first == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
        assert last == {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}
        for t in toks[1:-1]:
            assert t["special"] is False
            assert t["text"] == text[t["start"]:t["stop"]]  # character offsets, like TEI
    hello = out[0]
    assert [(t["text"], t["start"], t["stop"]) for t in hello[1:-1]] == [
        ("Hello", 0, 5), (",", 5, 6), ("world", 7, 12), ("!", 12, 13)]
    # Character (not byte) offsets past non-ASCII text.
    kyoto = [t for t in out[1] if t["text"] == "東"]
    assert kyoto and kyoto[0]["start"] == texts[1].index("東")


def test_tokenize_without_special_tokens(minilm_tokenizer):
    toks = tokenize_tei(minilm_tokenizer, ["Hello"], add_special_tokens=False)[0]
    assert toks == [{"id": 7592, "text": "Hello", "special": False, "start": 0, "stop": 5}]


def test_simple_tokens_rejects_misaligned_encodings():
    with pytest.raises(ValueError, match="disagree"):
        simple_tokens("ab", [1, 2], [(0, 1)], [0, 0], ["a", "b"])
