"""Bearer API keys: the router's middleware over real HTTP (Starlette's client), no cluster."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from embedfleet.deployments.api.auth import ApiKeyMiddleware, key_matches, load_api_keys


def make_client(keys: tuple[bytes, ...]) -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware, keys_provider=lambda: keys)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings():
        return {"object": "list"}

    return TestClient(app)


def test_keys_from_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# ops keys\nsk-one\n\n  sk-two  # rotated 2026-11\n")
    monkeypatch.setenv("MY_KEYS", "sk-three, sk-four,")
    assert load_api_keys(str(f), "MY_KEYS") == (b"sk-one", b"sk-two", b"sk-three", b"sk-four")
    assert load_api_keys(None, "UNSET_VARIABLE_X") == ()


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "Basic sk-one"}, 401),
    ({"Authorization": "Bearer "}, 401),
    ({"Authorization": "Bearer sk-one"}, 200),
    ({"Authorization": "bearer sk-two"}, 200),
])
def test_protected_route(headers, status):
    resp = make_client((b"sk-one", b"sk-two")).post("/v1/embeddings", headers=headers)
    assert resp.status_code == status
    if status == 401:
        err = resp.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert set(err) == {"message", "type", "param", "code"}


def test_health_stays_open_and_no_keys_means_open():
    assert make_client((b"k",)).get("/health").status_code == 200
    assert make_client(()).post("/v1/embeddings").status_code == 200


def test_key_match_is_exact():
    assert key_matches(b"abc", (b"xyz", b"abc"))
    assert not key_matches(b"ab", (b"abc",)) and not key_matches(b"abcd", (b"abc",))


def test_health_stays_open_under_a_route_prefix():
    """Serve serves an app under its route prefix with ``root_path`` set (an app deployed at
    ``/direct`` in tests/test_e2e_direct_ingress.py): /health is still the open route."""
    client = TestClient(make_client((b"sk-one",)).app, root_path="/direct")
    assert client.get("/direct/health").status_code == 200
    assert client.post("/direct/v1/embeddings").status_code == 401
