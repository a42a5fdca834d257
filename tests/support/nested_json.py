"""JSON bodies nested to a given depth in a given field, and the check every answer to one must
pass: a 2xx, or a 4xx with the OpenAI error body of bounded size - never a 5xx.

Shared by the in-process property test (tests/test_nesting.py) and the live fuzz test
(tests/test_e2e_fuzz.py). Bodies are built as bytes, level by level: ``json.dumps`` itself stops
near 1,000 levels, and the point is to send what a client can, up to and past the parser's
1,024.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from embedfleet.deployments.ingress.openai import EmbeddingRequest
from embedfleet.deployments.ingress.cohere import CohereEmbedRequest
from embedfleet.deployments.ingress.rerank import RerankApiRequest, ScoreRequest, TeiRerankRequest
from embedfleet.deployments.ingress.tei import TeiEmbedRequest, TeiTokenizeRequest

# Every depth a few levels either side of where something changes: 1..64 all, orjson's
# encoder (255) and parser (1,024) limits, the 300 and 800, and the far end.
DEPTHS = tuple(range(1, 65)) + (127, 128, 253, 254, 255, 256, 257, 300, 511, 512, 513, 800,
                                1000, 1022, 1023, 1024, 1025, 1026, 2048, 4096, 4999, 5000)
# One nesting level: how it opens and closes. "item" and "field" put a valid sibling first, so
# the deep part is not the first thing a validator sees.
LEVELS = {"list": (b"[", b"]"), "dict": (b'{"k":', b"}"), "item": (b'["a",', b"]"),
          "field": (b'{"a":1,"k":', b"}")}
ERROR_KEYS = {"message", "type", "param", "code"}
# An error message may echo a client's value only through errors.clip (64 characters of it);
# the longest fixed text around an echo is well under this.
MAX_MESSAGE = 400


def nested(depth: int, kinds: tuple[str, ...] = ("list",), leaf: bytes = b'"a"') -> bytes:
    """``leaf`` inside ``depth`` levels, level i of kind ``kinds[i % len(kinds)]``."""
    levels = [LEVELS[kinds[i % len(kinds)]] for i in range(depth)]
    return b"".join(o for o, _ in levels) + leaf + b"".join(c for _, c in reversed(levels))


# The request model of each JSON route, and the smallest valid body of it.
ROUTES: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/v1/embeddings": (EmbeddingRequest, {"input": "a"}),  # + the model, set by the caller
    "/embed": (TeiEmbedRequest, {"inputs": "a"}),
    "/tokenize": (TeiTokenizeRequest, {"inputs": "a"}),
    # "model": None = the caller's model goes there
    "/v2/embed": (CohereEmbedRequest, {"model": None, "texts": ["a"],
                                       "input_type": "search_document"}),
    "/rerank": (TeiRerankRequest, {"query": "a", "texts": ["a"]}),
    "/v1/rerank": (RerankApiRequest, {"model": None, "query": "a", "documents": ["a"]}),
    "/v2/rerank": (RerankApiRequest, {"model": None, "query": "a", "documents": ["a"]}),
    "/score": (ScoreRequest, {"model": None, "text_1": "a", "text_2": "a"}),
}
# Where the deep value goes: each typed field, the whole body, and an unknown parameter.
WHOLE_BODY, UNKNOWN_FIELD = "<body>", "<unknown>"


def places(path: str) -> list[str]:
    return sorted(ROUTES[path][0].model_fields) + [WHOLE_BODY, UNKNOWN_FIELD]


def body_with(path: str, model: str, where: str, value: bytes) -> bytes:
    """The route's valid body with ``value`` (raw JSON) in place ``where``."""
    if where == WHOLE_BODY:
        return value
    base = dict(ROUTES[path][1])
    if path == "/v1/embeddings" or "model" in base:
        base["model"] = model
    base.pop(where, None)
    key = "zz_unknown" if where == UNKNOWN_FIELD else where
    rest = json.dumps(base).encode()[1:-1]
    return b"{" + rest + (b"," if rest else b"") + json.dumps(key).encode() + b":" + value + b"}"


def check_answer(status: int, body: bytes, what: str) -> None:
    """No 5xx; a 4xx carries exactly the OpenAI error body, its message bounded."""
    where = f"{what} -> {status} {body[:300]!r}"
    assert status < 500, f"server error: {where}"
    assert status < 300 or 400 <= status, where
    if status < 400:
        return
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a {status} without the OpenAI error body: {where}") from None
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, where
    assert isinstance(err["message"], str) and 0 < len(err["message"]) <= MAX_MESSAGE, where
    assert isinstance(err["type"], str) and isinstance(err["code"], str), where
    assert err["param"] is None or (isinstance(err["param"], str)
                                    and len(err["param"]) <= MAX_MESSAGE), where
