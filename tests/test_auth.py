"""Bearer API keys: parsing the keys file, failing closed, the middleware over real HTTP
(Starlette's client), per-key model allow-lists, and rotation by rewriting the file. No
cluster."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from embedfleet.deployments.ingress.auth import (MIN_KEY_CHARS, ApiKeyMiddleware, ApiKeys, KeyLimits,
                                             KeyRing, KeysError, check_model_allowed, key_matches,
                                             load_api_keys, load_keys, parse_keys_file)
from embedfleet.deployments.ingress.router import new_api, serve_api_keys
from embedfleet.deployments.config.schema import DEFAULT_CONFIG_PATH, load_config
from embedfleet.deployments.common.errors import EmbedfleetError, error_response

ONE, TWO = "sk-one-0123456789abcdef", "sk-two-0123456789abcdef"


def make_client(keys: tuple[bytes, ...], models: dict | None = None) -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware, keys_provider=lambda: keys,
                       models_provider=lambda: models or {})

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        try:  # the check the routes make once they know the model
            check_model_allowed(request.state, request.headers.get("x-model", "a"))
        except EmbedfleetError as err:
            return error_response(err)
        return {"object": "list"}

    return TestClient(app)


# -- the keys file ------------------------------------------------------------------------------

def test_keys_from_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text(f"# ops keys\n{ONE}\n\n  {TWO}  \n   # rotated 2026-11\n")
    monkeypatch.setenv("MY_KEYS", "sk-three-0123456789abc, sk-four-0123456789abcd,")
    assert load_api_keys(str(f), "MY_KEYS") == (
        ONE.encode(), TWO.encode(), b"sk-three-0123456789abc", b"sk-four-0123456789abcd")
    assert load_keys(None, None).keys == ()  # no source named: open (allowed on loopback only)


def test_a_hash_inside_a_key_is_part_of_the_key():
    assert parse_keys_file("sk-abc#def-0123456789\n", "keys") == {
        "sk-abc#def-0123456789": KeyLimits()}


def test_a_trailing_comment_is_refused_not_silently_cut():
    with pytest.raises(KeysError, match=r"keys:1: .*'#'.*comment only at the start"):
        parse_keys_file(f"{ONE} # the indexer\n", "keys")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # another\n"])
def test_a_keys_file_without_keys_is_an_error(tmp_path, text):
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(KeysError, match="holds no API key"):
        load_keys(str(f), None)


def test_short_keys_and_unprintable_keys_are_refused_naming_the_line_not_the_key():
    short = "x" * (MIN_KEY_CHARS - 1)
    with pytest.raises(KeysError, match=rf"keys:2: a key of {MIN_KEY_CHARS - 1} characters") \
            as info:
        parse_keys_file(f"{ONE}\n{short}\n", "keys")
    assert short not in str(info.value)
    assert parse_keys_file("x" * MIN_KEY_CHARS, "keys")  # the bound itself is accepted
    with pytest.raises(KeysError, match="visible ASCII"):
        parse_keys_file("sk-ключ-0123456789abcdef\n", "keys")


def test_env_keys_are_checked_too(monkeypatch):
    monkeypatch.setenv("MY_KEYS", f"{ONE},short")
    with pytest.raises(KeysError, match=r"MY_KEYS \(key 2\)"):
        load_keys(None, "MY_KEYS")


def test_lane_and_model_limits_parse_and_unknown_options_fail():
    table = parse_keys_file(f"{ONE} lane=bulk models=a,b\n{TWO} models=c\n", "keys")
    assert table[ONE] == KeyLimits("bulk", frozenset({"a", "b"}))
    assert table[TWO] == KeyLimits(None, frozenset({"c"}))
    for bad in ("models=", "models=a,,b", "model=a", "lane=fast", "models=a models=b"):
        with pytest.raises(KeysError, match="keys:1: expected"):
            parse_keys_file(f"{ONE} {bad}\n", "keys")


def test_an_allow_list_naming_a_model_the_app_does_not_serve_fails_at_start(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{ONE} models=all-minilm-l6-v2,typo-model\n")
    with pytest.raises(KeysError, match="'typo-model', not served by this app"):
        load_keys(str(f), None, ["all-minilm-l6-v2"])


# -- failing closed: an ingress replica whose config names keys but finds none ---------------

def _cfg(**router):
    cfg = load_config(DEFAULT_CONFIG_PATH)
    return cfg.model_copy(update={"router": cfg.router.model_copy(update=router)})


def test_a_replica_whose_keys_file_is_missing_fails_to_start(tmp_path, caplog):
    app = new_api()
    with caplog.at_level(logging.ERROR, "embedfleet.router"), pytest.raises(
            KeysError, match="cannot read it on this node"):
        serve_api_keys(app, _cfg(api_keys_file=str(tmp_path / "absent")))
    assert app.state.api_keys == ()  # nothing was served, so nothing could be served open
    assert "refuses to start" in caplog.text


def test_a_replica_whose_keys_env_is_unset_fails_to_start(monkeypatch):
    monkeypatch.delenv("EMBEDFLEET_TEST_KEYS_ABSENT", raising=False)
    with pytest.raises(KeysError, match="unset or empty"):
        serve_api_keys(new_api(), _cfg(api_keys_env="EMBEDFLEET_TEST_KEYS_ABSENT"))


def test_a_replica_with_keys_enforces_them_and_their_model_limits(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{ONE}\n{TWO} lane=bulk models=all-minilm-l6-v2\n")
    app = new_api()
    serve_api_keys(app, _cfg(api_keys_file=str(f)))
    assert set(app.state.api_keys) == {ONE.encode(), TWO.encode()}
    assert app.state.key_lanes == {TWO.encode(): "bulk"}
    assert app.state.key_models == {TWO.encode(): frozenset({"all-minilm-l6-v2"})}


# -- the middleware ------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong-0123456789abcdef"}, 401),
    ({"Authorization": f"Basic {ONE}"}, 401),
    ({"Authorization": "Bearer "}, 401),
    ({"Authorization": f"Bearer {ONE}"}, 200),
    ({"Authorization": f"bearer {TWO}"}, 200),
])
def test_protected_route(headers, status):
    resp = make_client((ONE.encode(), TWO.encode())).post("/v1/embeddings", headers=headers)
    assert resp.status_code == status
    if status == 401:
        err = resp.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert set(err) == {"message", "type", "param", "code"}


def test_health_stays_open_and_no_keys_means_open():
    assert make_client((ONE.encode(),)).get("/health").status_code == 200
    assert make_client(()).post("/v1/embeddings").status_code == 200


def test_key_match_is_exact():
    assert key_matches(b"abc", (b"xyz", b"abc"))
    assert not key_matches(b"ab", (b"abc",)) and not key_matches(b"abcd", (b"abc",))


def test_health_stays_open_under_a_route_prefix():
    """Serve serves an app under its route prefix with ``root_path`` set (an app deployed at
    ``/direct`` in tests/test_e2e_direct_ingress.py): /health is still the open route."""
    client = TestClient(make_client((ONE.encode(),)).app, root_path="/direct")
    assert client.get("/direct/health").status_code == 200
    assert client.post("/direct/v1/embeddings").status_code == 401


def test_a_key_limited_to_some_models_gets_403_for_another():
    client = make_client((ONE.encode(), TWO.encode()),
                         models={TWO.encode(): frozenset({"a", "b"})})
    limited = {"Authorization": f"Bearer {TWO}"}
    assert client.post("/v1/embeddings", headers={**limited, "x-model": "b"}).status_code == 200
    resp = client.post("/v1/embeddings", headers={**limited, "x-model": "c" * 10_000})
    assert resp.status_code == 403
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "permission_error", "model_not_allowed", "model")
    assert "a, b" in err["message"] and len(err["message"]) < 300  # the name is clipped
    # a key without a list may use any model
    assert client.post("/v1/embeddings", headers={"Authorization": f"Bearer {ONE}",
                                                  "x-model": "c"}).status_code == 200


# -- rotation: the keys file re-read when it changes --------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _rewrite(path, text: str) -> None:
    """A new version of the file, as an editor or the kubelet's Secret update leaves it."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)  # a new inode: seen even within the file system's mtime resolution


def test_a_changed_keys_file_is_enforced_after_the_recheck_without_a_restart(tmp_path):
    f, clock = tmp_path / "keys", Clock()
    f.write_text(f"{ONE}\n")
    ring = KeyRing(str(f), None, recheck_s=5, clock=clock)
    _rewrite(f, f"{ONE}\n{TWO} models=a\n")
    clock.t = 4.9
    assert ring.current().keys == (ONE.encode(),)  # no stat before the recheck is due
    clock.t = 5.0
    assert ring.current().keys == (ONE.encode(), TWO.encode())
    assert ring.current().limits_of(TWO.encode()).models == frozenset({"a"})
    _rewrite(f, f"{TWO}\n")  # the old key retired
    clock.t = 10.0
    assert ring.current().keys == (TWO.encode(),)


@pytest.mark.parametrize("broken", ["", "# all keys removed by mistake\n", "short\n"])
def test_a_broken_rewrite_keeps_the_keys_it_had_never_opens(tmp_path, broken, caplog):
    f, clock = tmp_path / "keys", Clock()
    f.write_text(f"{ONE}\n")
    ring = KeyRing(str(f), None, recheck_s=5, clock=clock,
                   log=logging.getLogger("embedfleet.router"))
    _rewrite(f, broken)
    clock.t = 5.0
    with caplog.at_level(logging.ERROR, "embedfleet.router"):
        assert ring.current().keys == (ONE.encode(),)
    assert "keeping the 1 keys loaded before" in caplog.text


def test_the_ingress_app_follows_a_rotation(tmp_path):
    """The Router's own app (``new_api`` + ``serve_api_keys``): a key added to the file is
    accepted and a removed one refused, on the next request after the recheck."""
    f, clock = tmp_path / "keys", Clock()
    f.write_text(f"{ONE}\n")
    cfg = _cfg(api_keys_file=str(f))
    app = new_api()

    @app.get("/v1/models")
    def models():
        return {"data": []}

    serve_api_keys(app, cfg)
    app.state.key_ring = KeyRing(str(f), None, recheck_s=5, clock=clock)  # a hand-moved clock
    client = TestClient(app)
    one, two = ({"Authorization": f"Bearer {k}"} for k in (ONE, TWO))
    assert client.get("/v1/models", headers=one).status_code == 200
    assert client.get("/v1/models", headers=two).status_code == 401
    _rewrite(f, f"{TWO}\n")
    clock.t = 5.0
    assert client.get("/v1/models", headers=two).status_code == 200
    assert client.get("/v1/models", headers=one).status_code == 401


def test_the_key_sets_fingerprint_tells_sets_apart_and_no_key():
    a = load_keys(None, None, environ=None)
    one = parse_keys_file(f"{ONE}\n{TWO}\n", "k")
    same = ApiKeys(tuple(k.encode() for k in reversed(list(one))))
    other = ApiKeys((ONE.encode(),))
    assert same.fingerprint() == ApiKeys(tuple(k.encode() for k in one)).fingerprint()
    assert other.fingerprint() != same.fingerprint() != a.fingerprint()
    assert ONE not in same.fingerprint() and len(same.fingerprint()) == len("sha256:") + 12


def test_a_direct_ingress_replica_fails_on_missing_keys_before_it_loads_an_engine(tmp_path,
                                                                                monkeypatch):
    """A one-model app's engine replica takes HTTP itself: it checks its keys first, so a node
    without them costs no engine start (minutes on a card) before the replica fails."""
    import asyncio

    from embedfleet.deployments.ingress.direct import DirectEngine
    from embedfleet.deployments.config.schema import config_to_data
    from embedfleet.deployments.replica.engine_replica import EngineReplica

    def no_engine(*a, **k):
        raise AssertionError("the engine replica started before its keys were checked")

    for step in ("__init__", "build", "start"):  # any way of making the replica it holds
        monkeypatch.setattr(EngineReplica, step, no_engine)
    cfg = _cfg(api_keys_file=str(tmp_path / "absent"))
    replica = object.__new__(DirectEngine)
    replica._app = new_api()
    with pytest.raises(KeysError, match="cannot read it on this node"):
        asyncio.run(DirectEngine.__init__(replica, config_to_data(cfg), cfg.models[0].name))
