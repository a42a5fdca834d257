"""No 5xx from any body within the size limit: JSON nested 1..5,000 levels deep in every typed
field of every JSON route, through the router's real app (``mount_routes(app, Router)``), its real
pipeline and the shipped body limit; only the model's replicas and tokenizer are stand-ins, since
a body this wrong never reaches them (and one that does is answered like any other).

The bug this guards: orjson parses 1,024 levels but encodes only 254, so a validation error that
echoed a 255..1,024-deep value through orjson was a 500. Messages now echo through
``errors.clip``, which reads no deeper than it shows.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.support.nested_json import (DEPTHS, LEVELS, ROUTES, body_with, check_answer, nested,
                                       places)
from tests.support.router_app import MODEL, one_model_config, router_client


@pytest.fixture(scope="module")
def client():
    cfg = one_model_config()  # the shipped body limit
    # the deepest bodies below are far inside it: the limit is not what saves them
    assert len(nested(5000, ("field",))) < cfg.router.max_body_bytes
    with router_client(cfg) as c:
        yield c


def post(client: TestClient, path: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    check_answer(r.status_code, r.content, f"POST {path} {body[:120]!r}...({len(body)} bytes)")


def test_every_json_route_is_swept(client):
    """A route that takes a JSON body, now or later, is in ``ROUTES`` with its request model."""
    doc = client.get("/openapi.json").json()
    with_body = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
                 for path, ops in doc["paths"].items() if "requestBody" in ops.get("post", {})}
    assert set(with_body) == set(ROUTES)
    for path, schema in with_body.items():
        assert set(schema["properties"]) == set(ROUTES[path][0].model_fields), path


def test_the_issues_body_300_levels_deep_in_input_is_a_422_not_a_500(client):
    body = body_with("/v1/embeddings", MODEL, "input", nested(300))
    r = client.post("/v1/embeddings", content=body,
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and err["code"] == "invalid_value"


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_every_depth_in_every_field(client, path, kind):
    """Deterministic: each depth of ``DEPTHS`` in each field, the whole body and an unknown
    parameter."""
    t0 = time.monotonic()
    for where in places(path):
        for depth in DEPTHS:
            post(client, path, body_with(path, MODEL, where, nested(depth, (kind,))))
    assert time.monotonic() - t0 < 60  # bounded work per body, whatever its depth


@st.composite
def deep_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    where = draw(st.sampled_from(places(path)))
    depth = draw(st.integers(1, 5000) | st.sampled_from(DEPTHS))
    kinds = tuple(draw(st.lists(st.sampled_from(sorted(LEVELS)), min_size=1, max_size=4)))
    leaf = draw(st.sampled_from([b'"a"', b'""', b"0", b"-1", b"1.5", b"true", b"null", b"[]",
                                 b"{}", b'"' + b"x" * 2000 + b'"', b"18446744073709551615"]))
    return path, body_with(path, MODEL, where, nested(depth, kinds, leaf))


@settings(max_examples=400, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=deep_bodies())
def test_mixed_nesting_of_any_depth_anywhere(client, case):
    """Random mixes of list and object levels, with a sibling before the deep part or not,
    and a leaf of any JSON type at the bottom."""
    path, body = case
    post(client, path, body)
