"""OpenAI request validation and response encoding, without a cluster."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from embedfleet.deployments.common.errors import EngineUnavailable, InputTooLong, Overloaded, RequestValidation
from embedfleet.deployments.ingress.openai import embedding_response, parse_embedding_request


@pytest.mark.parametrize("value, expected", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_input_shapes_normalise(value, expected):
    assert parse_embedding_request({"model": "m", "input": value}).input == expected


def test_validation_error_names_param_and_item():
    with pytest.raises(RequestValidation) as err:
        parse_embedding_request({"model": "m", "input": ["a", 3]})
    assert err.value.param == "input" and "mixes" in err.value.message
    assert err.value.status == 422


def test_response_float_and_base64():
    v = np.array([0.5, -0.25, 1.0], np.float32)
    body = orjson.loads(embedding_response([v], model="m", prompt_tokens=7, encoding="float"))
    assert body["data"][0]["embedding"] == [0.5, -0.25, 1.0]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    b64 = orjson.loads(embedding_response([v], model="m", prompt_tokens=7, encoding="base64"))
    raw = base64.b64decode(b64["data"][0]["embedding"])
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), v)


def test_errors_pickle_and_carry_status_and_retry_after():
    import pickle

    err = pickle.loads(pickle.dumps(Overloaded("busy", retry_after_s=2.4)))
    assert err.status == 429 and err.headers() == {"Retry-After": "2"}
    assert err.body()["error"]["type"] == "rate_limit_error"
    too_long = pickle.loads(pickle.dumps(InputTooLong("300 > 256", param="input")))
    assert too_long.status == 400 and too_long.param == "input"
    assert EngineUnavailable("x", retry_after_s=1).status == 503


def test_validation_message_never_splits_a_multibyte_character():
    # Found by the fuzzer: a 500 when the echoed value was cut inside a UTF-8 sequence.
    for pad in range(0, 8):
        with pytest.raises(RequestValidation) as err:
            parse_embedding_request({"model": "m", "input": "a", "task": ["x" * pad + "é" * 120]})
        assert err.value.param == "task" and "got" in err.value.message


def deep(depth: int) -> list:
    root = node = []
    for _ in range(depth - 1):
        node.append([])
        node = node[0]
    return root


@pytest.mark.parametrize("depth", [254, 255, 300, 800, 1024])
@pytest.mark.parametrize("field", ["input", "model", "encoding_format", "dimensions", "user",
                                   "lane"])
def test_a_value_nested_past_orjsons_encoder_is_a_422_with_a_short_echo(field, depth):
    # orjson parses 1,024 levels but encodes 254: echoing the value through it was a 500
    body = {"model": "m", "input": "a", field: deep(depth)}
    with pytest.raises(RequestValidation) as err:
        parse_embedding_request(body)
    assert err.value.param == field and len(err.value.message) < 200


def test_an_unknown_parameter_is_named_but_bounded():
    with pytest.raises(RequestValidation) as err:
        parse_embedding_request({"model": "m", "input": "a", "x.y": 1})
    assert err.value.param == "x.y" and err.value.message.endswith("supplied: 'x.y'")
    with pytest.raises(RequestValidation) as err:
        parse_embedding_request({"model": "m", "input": "a", "k" * 100_000: 1})
    assert err.value.param == "k" * 64 + "…" and "(100000 chars)" in err.value.message
