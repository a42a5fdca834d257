"""Cohere's own SDK (``cohere`` in the test extra) against the router's real rerank routes in
process, with the STAND-IN reranker of tests/test_rerank_routes.py (a score per document from
its length): ``ClientV2.rerank`` posts to /v2/rerank and v1's ``Client.rerank`` to /v1/rerank,
and each must parse what embedfleet answers into its typed response, best first."""

from __future__ import annotations

import pytest

from tests.support.sdk_transport import in_process_httpx
from tests.test_rerank_routes import DOCS, client, standin_score

cohere = pytest.importorskip("cohere")

BEST_FIRST = sorted(range(len(DOCS)), key=lambda i: -standin_score(DOCS[i]))


@pytest.fixture
def http():
    calls: list = []
    with client(calls) as c:
        yield c, calls


def sdk(http, v2: bool):
    test_client, _ = http
    cls = cohere.ClientV2 if v2 else cohere.Client
    return cls(api_key="none", base_url="http://testserver", max_retries=0,
               httpx_client=in_process_httpx(test_client))


def test_client_v2_rerank_parses_v2_rerank(http):
    _, calls = http
    resp = sdk(http, v2=True).rerank(model="rr", query="q", documents=DOCS)
    assert isinstance(resp, cohere.V2RerankResponse) and resp.id.startswith("rr-")
    assert [r.index for r in resp.results] == BEST_FIRST
    assert [r.relevance_score for r in resp.results] == [standin_score(DOCS[i])
                                                         for i in BEST_FIRST]
    # v2's SDK has no return_documents; vLLM's answer echoes them and the SDK keeps the extra
    assert [r.document["text"] for r in resp.results] == [DOCS[i] for i in BEST_FIRST]
    assert calls[-1].query == "q" and calls[-1].documents == DOCS and calls[-1].model == "rr"
    top = sdk(http, v2=True).rerank(model="rr", query="q", documents=DOCS, top_n=2)
    assert [r.index for r in top.results] == BEST_FIRST[:2]


def test_client_v1_rerank_parses_v1_rerank(http):
    co = sdk(http, v2=False)
    resp = co.rerank(model="rr", query="q", documents=DOCS, return_documents=True)
    assert isinstance(resp, cohere.RerankResponse)
    assert [r.index for r in resp.results] == BEST_FIRST
    assert [r.relevance_score for r in resp.results] == [standin_score(DOCS[i])
                                                         for i in BEST_FIRST]
    assert [r.document.text for r in resp.results] == [DOCS[i] for i in BEST_FIRST]
    bare = co.rerank(model="rr", query="q", documents=DOCS, top_n=3, return_documents=False)
    assert [r.index for r in bare.results] == BEST_FIRST[:3]
    assert all(r.document is None for r in bare.results)


@pytest.mark.parametrize("v2", [True, False])
def test_the_sdk_raises_the_role_error(http, v2):
    with pytest.raises(cohere.core.ApiError) as err:
        sdk(http, v2).rerank(model="emb", query="q", documents=DOCS)
    assert err.value.status_code == 400
    assert "is an embedding model" in err.value.body["error"]["message"]
