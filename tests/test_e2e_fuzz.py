"""Property-based fuzzing of the router: whatever a client sends, it never gets a 5xx.

Hypothesis generates requests against the live session cluster:
  * ``POST /v1/embeddings`` bodies drawn from the request schema itself
    (``EmbeddingRequest.model_json_schema()``, widened by OpenAI's two input shapes the schema of
    the *normalised* request does not show: a bare string and a flat token-id list), then mutated
    with junk — wrong types, huge ints, nested lists, unicode and lone surrogates, bools, nulls,
    extra fields — or replaced by raw junk: random bytes, truncated JSON, pathological nesting,
    and random content types;
  * ``GET /v1/models``, ``/health``, ``/ready``, unknown paths and every method on them.

Properties checked on every response:
  * no 5xx (the one allowed exception: ``/ready`` answers 503 by contract when a model has no ready
    replica — that is the readiness signal, not a server error);
  * every 4xx/5xx carries exactly the OpenAI error body ``{"error": {message, type, param,
    code}}``; 429/503 also carry ``Retry-After``; a 3xx (FastAPI's trailing-slash redirect) is
    not an error and must point back at the same path;
  * every 200 from ``/v1/embeddings`` has one vector per input, in order, all of one size.

Inputs are kept small (short texts, at most 8 items, token ids mostly inside the shared 30522-id
MiniLM vocabulary) so the ~380 requests take about a minute on 2 idle cores. ``derandomize=True``
makes the examples the same on every run, so CI failures reproduce.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from embedfleet.deployments.ingress.openai import EmbeddingRequest
from tests.conftest import FAULTY_QWEN3, MINILM, TINY_QWEN3
from tests.support.nested_json import ROUTES, body_with, check_answer, nested, places

pytestmark = pytest.mark.cluster

SERVED = (MINILM, TINY_QWEN3, FAULTY_QWEN3)
VOCAB = 30522            # MiniLM's tokenizer; the tiny Qwen3 models reuse it
MAX_ITEMS = 8
MAX_TEXT = 24
EMBEDDING_EXAMPLES = 300
ROUTE_EXAMPLES = 80
MIN_REQUESTS = 300
ERROR_KEYS = {"message", "type", "param", "code"}

# No shrink phase: shrinking a failure against a live server re-sends requests for up to 5
# minutes; the assertion message already holds the exact failing request, byte for byte.
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                     phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much])

# What was actually sent, for the final count and the histogram printed at the end.
SENT: Counter[str] = Counter()


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None = None

    def describe(self) -> str:
        body = self.body if self.body is None or len(self.body) < 600 else self.body[:600] + b"..."
        return f"{self.method} {self.path} headers={self.headers} body={body!r}"


# -- strategies: values -----------------------------------------------------------------------
def _token_ids(lo: int | None = None) -> st.SearchStrategy[int]:
    """Mostly ids the models know; a few at and past the vocabulary edge, negative and huge
    (2**64-1 is the largest int the router's JSON parser keeps an int)."""
    lo = -(2 ** 63) if lo is None else lo
    inside = st.integers(max(lo, 0), VOCAB - 1)
    edges = st.sampled_from([v for v in (-1, -7, 0, VOCAB - 1, VOCAB, VOCAB + 1, 2 ** 31,
                                         2 ** 63 - 1, 2 ** 64 - 1) if v >= lo])
    return st.one_of(inside, inside, inside, inside, edges)


_texts = st.text(max_size=MAX_TEXT)


def from_schema(schema: dict[str, Any], defs: dict[str, Any] | None = None,
                overrides: dict[str, st.SearchStrategy[Any]] | None = None
                ) -> st.SearchStrategy[Any]:
    """A strategy for instances of the subset of JSON Schema pydantic emits for the request
    model, with sizes capped so requests stay cheap to embed. ``overrides`` replaces the
    strategy of top-level object properties by name."""
    defs = defs if defs is not None else schema.get("$defs", {})
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs) for s in schema["anyOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", MAX_TEXT), MAX_TEXT))
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2 ** 63) - 1) + 1)
        return _token_ids(lo)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs),
                        min_size=schema.get("minItems", 0), max_size=MAX_ITEMS)
    if kind == "object":
        overrides = overrides or {}
        props = {k: overrides[k] if k in overrides else from_schema(v, defs)
                 for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items()
                                               if k not in required})
    return json_junk


json_junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats()
    | st.text(max_size=12)
    # long non-ASCII text: error messages echo the offending value cut to a length, and a cut
    # must not split a multi-byte character
    | st.text(st.characters(min_codepoint=0x80), min_size=30, max_size=110)
    | st.sampled_from(["", " ", "\x00", "\ud800", "💥" * 3, "a" * 200, "\u202e\u200b"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)

_SCHEMA = EmbeddingRequest.model_json_schema()
# The served names most of the time (so requests reach the engines), schema strings otherwise.
_models = st.one_of(*[st.just(m) for m in SERVED], from_schema(_SCHEMA["properties"]["model"]))
# OpenAI's four input shapes: the schema holds the two list forms; add a bare string and a flat
# token-id list, which the validator normalises.
# Non-empty forms repeated: left alone, generation favours empty strings and lists (all 422s),
# and the 200 path needs exercising too.
_word = st.text(min_size=1, max_size=MAX_TEXT)
_inputs = st.one_of(from_schema(_SCHEMA["properties"]["input"]), _texts, _word, _word,
                    st.lists(_word, min_size=1, max_size=MAX_ITEMS),
                    st.lists(_word, min_size=1, max_size=MAX_ITEMS),
                    st.lists(_token_ids(), max_size=MAX_ITEMS),
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_ITEMS),
                    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_ITEMS),
                             min_size=1, max_size=4))
# `dimensions` mostly absent or null: no served model is Matryoshka, so any value is a 400.
_dimensions = st.one_of(st.none(), st.none(), from_schema(_SCHEMA["properties"]["dimensions"]))
_valid_ish = from_schema(_SCHEMA, overrides={"model": _models, "input": _inputs,
                                             "dimensions": _dimensions})


@st.composite
def _mutated(draw) -> Any:
    """A schema body with one deliberate defect (or, sometimes, none)."""
    body = dict(draw(_valid_ish))
    how = draw(st.sampled_from(["none"] * 4 + ["set", "set", "drop", "extra", "nest", "replace"]))
    keys = sorted(_SCHEMA["properties"])
    if how == "set":
        body[draw(st.sampled_from(keys))] = draw(json_junk | st.integers(-(2 ** 80), 2 ** 80))
    elif how == "drop":
        body.pop(draw(st.sampled_from(keys)), None)
    elif how == "extra":
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_junk)
    elif how == "nest":
        depth = draw(st.integers(1, 4))
        for _ in range(depth):
            body["input"] = [body.get("input")]
    elif how == "replace":
        return draw(json_junk)
    return body


def _dump(value: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes invalid UTF-8 on the wire, which is itself junk.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


_json_bodies = st.builds(_dump, _mutated(), st.booleans())
_CLASSIC_JUNK = [b"", b"null", b"{}", b"[]", b"0", b'"x"', b"{", b"NaN", b'{"input": NaN}',
                 b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                 # the 500s: a value nested 300 and 800 deep in `input`
                 body_with("/v1/embeddings", MINILM, "input", nested(300)),
                 body_with("/v1/embeddings", MINILM, "input", nested(800, ("dict",))),
                 b"\xef\xbb\xbf{}", b'{"model": "all-minilm-l6-v2", "input": [1e400]}',
                 b'{"model": "all-minilm-l6-v2", "input": "\\ud800"}',
                 b'{"model": "all-minilm-l6-v2", "input": [18446744073709551616]}']
_raw_bodies = st.one_of(
    st.binary(max_size=64),
    _json_bodies.flatmap(lambda b: st.integers(0, max(len(b) - 1, 0)).map(lambda k: b[:k])),
    st.sampled_from(_CLASSIC_JUNK))
_JSON_TYPE = "application/json"
_content_types = st.one_of(
    *[st.just(_JSON_TYPE)] * 6,
    st.sampled_from(["application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/octet-stream", "application/jsonx", "application/json;;;",
                     ";", "", None]),
    st.from_regex(r"\A[a-z]{1,8}/[a-z0-9.+-]{1,12}\Z"))


def _embedding_request(body: bytes, ctype: str | None) -> Req:
    headers = {} if ctype is None else {"Content-Type": ctype}
    return Req("POST", "/v1/embeddings", headers, body)


embedding_requests = st.one_of(
    *[st.builds(_embedding_request, _json_bodies, st.just(_JSON_TYPE))] * 3,
    st.builds(_embedding_request, _json_bodies, _content_types),
    st.builds(_embedding_request, _raw_bodies, _content_types))

# -- strategies: routes and methods ---------------------------------------------------------------
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
_KNOWN = ["/v1/models", "/health", "/ready", "/v1/embeddings", "/embed", "/tokenize", "/",
          "/v1", "/v1/models/" + MINILM, "/v1/embeddings/", "/health/", "//health"]
_segments = st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3).map(
    lambda segs: "/" + "/".join(urllib.parse.quote(s, safe="") for s in segs))
_queries = st.one_of(st.just(""), st.dictionaries(st.text(max_size=6), st.text(max_size=6),
                                                  max_size=2).map(
    lambda q: "?" + urllib.parse.urlencode(q) if q else ""))


@st.composite
def route_requests(draw) -> Req:
    path = draw(st.one_of(st.sampled_from(_KNOWN), st.sampled_from(_KNOWN), _segments))
    method = draw(st.sampled_from(_METHODS))
    body = draw(st.one_of(st.none(), _json_bodies)) if method in {"POST", "PUT", "PATCH"} else None
    headers = {"Content-Type": _JSON_TYPE} if body is not None else {}
    return Req(method, path + draw(_queries), headers, body)


# -- properties ---------------------------------------------------------------------------------
def expected_inputs(body: bytes) -> int:
    """How many vectors a 200 for this body must hold (OpenAI's input-shape rules)."""
    inp = json.loads(body)["input"]
    if isinstance(inp, str):
        return 1
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
        return 1  # a flat list of ints is one tokenised input
    return len(inp)


def check(req: Req, resp: httpx.Response) -> None:
    where = f"{req.describe()}\n-> {resp.status_code} {resp.headers} {resp.text[:800]!r}"
    status = resp.status_code
    ready_probe = req.method in {"GET", "HEAD"} and req.path.split("?")[0] == "/ready"
    assert status < 500 or (status == 503 and ready_probe), f"server error:\n{where}"
    if status in (429, 503):
        assert resp.headers.get("retry-after"), f"{status} without Retry-After:\n{where}"
    if 300 <= status < 400:
        # FastAPI's trailing-slash redirect (307, empty body): not an error, so no error body;
        # it must point back at this server's path without the slash.
        location = urllib.parse.urlsplit(resp.headers.get("location", ""))
        assert location.path and req.path.split("?")[0].startswith(location.path), where
        return
    if status >= 400 and req.method != "HEAD":  # HEAD answers carry no body
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"non-2xx without an OpenAI error body:\n{where}") from None
        assert isinstance(err, dict) and set(err) == ERROR_KEYS, f"bad error keys:\n{where}"
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str) and isinstance(err["code"], str), where
        assert err["param"] is None or isinstance(err["param"], str), where
    if status == 200 and req.path.split("?")[0] == "/v1/embeddings" and req.method == "POST":
        try:
            data, n = resp.json()["data"], expected_inputs(req.body or b"")
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"200 for a body that is not a valid request:\n{where}") from None
        assert len(data) == n, f"vector count {len(data)} != {n} inputs:\n{where}"
        assert [d["index"] for d in data] == list(range(len(data))), where
        assert len({len(d["embedding"]) for d in data}) == 1, f"ragged vectors:\n{where}"


def send(client: httpx.Client, req: Req) -> None:
    try:
        resp = client.request(req.method, req.path, headers=req.headers, content=req.body)
    except httpx.TransportError as err:  # a hang or a dropped connection is a failure too
        raise AssertionError(f"no answer ({err!r}):\n{req.describe()}") from None
    SENT["total"] += 1
    SENT[str(resp.status_code)] += 1
    check(req, resp)


# Found by this fuzzer: the error message's echo of a wrongly-typed value was cut at byte 100 and
# decoded, so a multi-byte character across that byte made a 500 (UnicodeDecodeError).
ECHO_CUT = Req("POST", "/v1/embeddings", {"Content-Type": _JSON_TYPE},
               json.dumps({"model": MINILM, "input": [["a" * 96 + "\u00e9"]]}).encode())


@settings(max_examples=EMBEDDING_EXAMPLES, **FUZZ_SETTINGS)
@given(req=embedding_requests)
@example(req=ECHO_CUT)
def fuzz_embeddings(client: httpx.Client, req: Req) -> None:
    send(client, req)


@settings(max_examples=ROUTE_EXAMPLES, **FUZZ_SETTINGS)
@given(req=route_requests())
def fuzz_routes(client: httpx.Client, req: Req) -> None:
    send(client, req)


def wait_ready(client: httpx.Client, timeout_s: float = 300) -> None:
    """Start from a settled cluster, so a 503 from a replica still loading is not mistaken for
    a bug (and one that appears later is one)."""
    deadline = time.monotonic() + timeout_s
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "cluster not ready; cannot fuzz"
        time.sleep(2)


def test_router_never_answers_5xx_to_fuzzed_requests(cluster):
    SENT.clear()
    t0 = time.monotonic()
    with httpx.Client(base_url=cluster, timeout=60) as client:
        wait_ready(client)
        fuzz_embeddings(client)
        fuzz_routes(client)
    histogram = {k: v for k, v in sorted(SENT.items()) if k != "total"}
    print(f"\nfuzz: {SENT['total']} requests in {time.monotonic() - t0:.0f}s; "
          f"status histogram {histogram}")
    assert SENT["total"] >= MIN_REQUESTS, (SENT["total"], histogram)


# Each depth a little either side of where something changes: orjson's encoder (254 levels)
# and parser (1,024), the 300 and 800, and the far end; tests/test_nesting.py covers
# 1..5,000 in-process.
LIVE_DEPTHS = (1, 2, 3, 4, 5, 32, 64, 254, 255, 256, 300, 512, 800, 1023, 1024, 1025, 5000)


def test_no_5xx_at_any_nesting_depth_in_any_field(cluster):
    """Every JSON route of the live cluster, a value nested ``LIVE_DEPTHS`` deep (lists, and
    objects) in each typed field of its request model, as the whole body and as an unknown
    parameter: a 2xx, or a 4xx with the OpenAI error body of bounded size; never a 5xx."""
    sent = Counter()
    with httpx.Client(base_url=cluster, timeout=60) as client:
        wait_ready(client)
        for path in sorted(ROUTES):
            for where in places(path):
                for kind in ("list", "dict"):
                    for depth in LIVE_DEPTHS:
                        body = body_with(path, MINILM, where, nested(depth, (kind,)))
                        what = f"POST {path} {where} {kind} x{depth} ({len(body)} bytes)"
                        try:
                            r = client.post(path, content=body,
                                            headers={"Content-Type": _JSON_TYPE})
                        except httpx.TransportError as err:
                            raise AssertionError(f"no answer ({err!r}): {what}") from None
                        sent[r.status_code] += 1
                        check_answer(r.status_code, r.content, what)
    print(f"\nnesting: {sum(sent.values())} requests; status histogram "
          f"{dict(sorted(sent.items()))}")
    assert sent[422] > 0 and sent[400] > 0  # the models' errors and the parser's depth limit
