"""Every bad request gets its 4xx and an OpenAI-style error body; never a 500, never a hang."""

from __future__ import annotations

import json

import pytest
import requests

from tests.conftest import MINILM

pytestmark = pytest.mark.cluster

LONG_TEXT = "word " * 400  # ~402 tokens > MiniLM's 256
JSON = {"Content-Type": "application/json"}


def body(**kw) -> bytes:
    return json.dumps({"model": MINILM, **kw}).encode()


# (id, raw body, headers, expected status, expected code, expected param, text in message)
CASES = [
    ("invalid_json", b'{"model": "x", "input": [', JSON, 400, "invalid_json", None, "JSON"),
    ("empty_body", b"", JSON, 400, "invalid_json", None, "empty"),
    ("not_an_object", b'["a"]', JSON, 422, "invalid_value", None, "JSON object"),
    ("wrong_content_type", body(input="a"), {"Content-Type": "text/plain"}, 415,
     "unsupported_media_type", None, "text/plain"),
    ("form_content_type", body(input="a"), {"Content-Type": "application/x-www-form-urlencoded"},
     415, "unsupported_media_type", None, "application/json"),
    ("missing_input", json.dumps({"model": MINILM}).encode(), JSON, 422, "invalid_value",
     "input", "required"),
    ("missing_model", json.dumps({"input": "a"}).encode(), JSON, 422, "invalid_value", "model",
     "required"),
    ("empty_string", body(input=""), JSON, 422, "invalid_value", "input", "empty string"),
    ("empty_list", body(input=[]), JSON, 422, "invalid_value", "input", "empty list"),
    ("empty_string_in_list", body(input=["a", ""]), JSON, 422, "invalid_value", "input",
     "input[1]"),
    ("empty_token_list", body(input=[[1, 2], []]), JSON, 422, "invalid_value", "input",
     "empty token list"),
    ("input_number", body(input=5), JSON, 422, "invalid_value", "input", "int"),
    ("input_object", body(input={"text": "a"}), JSON, 422, "invalid_value", "input", "dict"),
    ("item_wrong_type", body(input=["a", {"x": 1}]), JSON, 422, "invalid_value", "input",
     "input[1]"),
    ("item_null", body(input=["a", None]), JSON, 422, "invalid_value", "input", "input[1]"),
    ("bool_as_token", body(input=[True, False]), JSON, 422, "invalid_value", "input",
     "bool"),
    ("mixed_str_and_ids", body(input=["a", 101]), JSON, 422, "invalid_value", "input", "mixes"),
    ("mixed_ids_and_lists", body(input=[101, [102]]), JSON, 422, "invalid_value", "input",
     "mixes"),
    ("negative_token", body(input=[101, -5, 102]), JSON, 422, "invalid_value", "input",
     "non-negative"),
    ("token_out_of_vocab", body(input=[101, 999999, 102]), JSON, 400, "invalid_token_id",
     "input", "999999"),
    ("too_many_inputs", body(input=["a"] * 513), JSON, 422, "too_many_inputs", "input", "513"),
    ("unknown_model", json.dumps({"model": "no-such-model", "input": "a"}).encode(), JSON, 404,
     "model_not_found", "model", "no-such-model"),
    ("model_is_a_path", json.dumps({"model": "/etc/passwd", "input": "a"}).encode(), JSON, 404,
     "model_not_found", "model", "/etc/passwd"),
    ("bad_encoding_format", body(input="a", encoding_format="int4"), JSON, 422, "invalid_value",
     "encoding_format", "int4"),
    ("dimensions_zero", body(input="a", dimensions=0), JSON, 422, "invalid_value", "dimensions",
     "greater than 0"),
    ("dimensions_negative", body(input="a", dimensions=-3), JSON, 422, "invalid_value",
     "dimensions", "greater than 0"),
    ("dimensions_not_supported", body(input="a", dimensions=128), JSON, 400,
     "unsupported_parameter", "dimensions", "does not support"),
    ("dimensions_too_large", body(input="a", dimensions=100000), JSON, 400,
     "unsupported_parameter", "dimensions", "384"),
    ("unknown_field", body(input="a", temperature=0.5), JSON, 422, "invalid_value",
     "temperature", "unrecognized"),
    ("input_too_long", body(input=LONG_TEXT), JSON, 400, "context_length_exceeded", "input",
     "256"),
    ("token_input_too_long", body(input=[101] * 300), JSON, 400, "context_length_exceeded",
     "input", "300"),
    ("body_too_large", body(input="x" * (4 << 20)), JSON, 413, "request_too_large", None,
     "4194304"),
]


@pytest.mark.parametrize("raw, headers, status, code, param, text",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx_with_openai_error(cluster, raw, headers, status, code, param, text):
    resp = requests.post(f"{cluster}/v1/embeddings", data=raw, headers=headers, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert err["param"] == param
    assert text in err["message"], err["message"]
    assert err["type"] == "invalid_request_error"


def test_input_too_long_names_both_lengths(cluster, minilm_tokenizer):
    n = len(minilm_tokenizer(LONG_TEXT)["input_ids"])
    resp = requests.post(f"{cluster}/v1/embeddings", data=body(input=["ok", LONG_TEXT]),
                         headers=JSON, timeout=60)
    msg = resp.json()["error"]["message"]
    assert resp.status_code == 400
    assert f"{n} tokens" in msg and "256" in msg and "input[1]" in msg


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/embeddings", 405, "method_not_allowed"),
    ("POST", "/v1/nothing-here", 404, "not_found"),
])
def test_unknown_routes_and_methods(cluster, method, path, status, code):
    resp = requests.request(method, f"{cluster}{path}", timeout=30)
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == code


def test_openai_client_raises_typed_errors(cluster):
    import openai

    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        client.embeddings.create(model="nope", input="a")
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.embeddings.create(model=MINILM, input="a", dimensions=64)
    assert br.value.body["param"] == "dimensions"
