"""What an error message may echo of a client's value (``errors.clip``): bounded whatever was sent,
and never itself the cause of a 500."""

from __future__ import annotations

import pytest

from embedfleet.deployments.common.errors import clip


def nested(depth: int) -> list:
    root = node = []
    for _ in range(depth - 1):
        node.append([])
        node = node[0]
    return root


def test_a_long_string_is_cut_with_an_ellipsis_and_its_length():
    assert clip("a" * 100_000) == "'" + "a" * 64 + "…' (100000 chars)"
    assert clip("a" * 65, limit=4) == "'aaaa…' (65 chars)"


@pytest.mark.parametrize("value", ["", "m", "a" * 64, 0, -3, 1.5, True, None, [], {}, (1,),
                                   [1, "x"], {"a": [1, 2, {"b": None}]}])
def test_a_short_value_is_its_repr(value):
    assert clip(value) == repr(value)


def test_escapes_count_against_the_limit():
    out = clip("\x00" * 100)
    assert out.startswith("'\\x00") and out.endswith("…' (100 chars)")
    assert len(out) <= 64 + len("…' (100 chars)") + 1


@pytest.mark.parametrize("depth", [1, 63, 64, 65, 255, 256, 1000, 1024, 5000, 50_000])
def test_deep_nesting_is_cut_without_recursing_through_it(depth):
    # repr() of a 1,000-deep list raises RecursionError, orjson.dumps TypeError past 254 levels
    out = clip(nested(depth))
    full = "[" * depth + "]" * depth  # what repr() would say
    assert out == (full if len(full) <= 64 else full[:64] + "… (1 item)")


def test_big_containers_and_ints_are_bounded():
    assert clip(["x"] * 1_000_000).endswith("… (1000000 items)")
    assert len(clip(["x"] * 1_000_000)) < 100
    assert clip({str(i): i for i in range(100)}).endswith("… (100 keys)")
    assert clip(10 ** 10_000) == "<int of 33220 bits>"  # repr() would raise past 4,300 digits
    assert len(clip(10 ** 100)) < 100


# -- what the routes echo ------------------------------------------------------------------------
BIG = 100_000


@pytest.fixture(scope="module")
def client():
    from tests.support.router_app import one_model_config, router_client

    with router_client(one_model_config()) as c:
        yield c


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert len(r.content) < 600, f"{len(r.content)}-byte error body: {r.text[:300]}"
    return err


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": "a", "model": "m" * BIG}),
    ("/embed", {"inputs": "a", "model": "m" * BIG}),
    ("/tokenize", {"inputs": "a", "model": "m" * BIG}),
])
def test_a_100kb_model_name_is_a_404_with_a_short_message(client, path, body):
    err = error_of(client.post(path, json=body), 404)
    assert err["code"] == "model_not_found" and f"({BIG} chars)" in err["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": "a", "model": "m", "k" * BIG: 1}),
    ("/embed", {"inputs": "a", "k" * BIG: 1}),
    ("/tokenize", {"inputs": "a", "k" * BIG: 1}),
])
def test_a_100kb_unknown_parameter_is_named_short(client, path, body):
    err = error_of(client.post(path, json=body), 422)
    assert "unrecognized request argument" in err["message"] and f"({BIG} chars)" in err["message"]
    assert err["param"].startswith("kkkk") and len(err["param"]) <= 65


@pytest.mark.parametrize("field, value", [
    ("encoding_format", "x" * BIG), ("user", ["x" * BIG]), ("dimensions", ["x"] * BIG),
    ("lane", {"k": "x" * BIG}),
])
def test_a_wrongly_typed_100kb_value_is_echoed_short(client, field, value):
    err = error_of(client.post("/v1/embeddings", json={"input": "a", "model": "m",
                                                       field: value}), 422)
    assert err["param"] == field and "…" in err["message"]


def test_a_long_path_and_content_type_are_echoed_short(client):
    long = 50_000  # the test client refuses a URL of 64 KiB
    err = error_of(client.get("/" + "p" * long), 404)
    assert f"({long + 1} chars)" in err["message"]
    err = error_of(client.post("/v1/embeddings", content=b"{}",
                               headers={"content-type": "text/" + "x" * BIG}), 415)
    assert f"({BIG + 5} chars)" in err["message"]


@pytest.mark.parametrize("declared, status", [("9" * 5000, 413), ("9" * 20, 413),
                                              ("²".encode("latin-1"), 200)])
def test_a_declared_length_of_any_shape_is_never_a_500(client, declared, status):
    # int() of 5,000 digits raises, and so does int('²') although '²'.isdigit()
    r = client.post("/v1/embeddings", content=b'{"input": "a", "model": "all-minilm-l6-v2"}',
                    headers={"content-type": "application/json", "content-length": declared})
    assert r.status_code == status, r.text[:300]
    if status == 413:
        assert len(r.json()["error"]["message"]) < 120
