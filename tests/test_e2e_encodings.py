"""Compact encodings end to end on MiniLM: the openai client and plain HTTP on /v1/embeddings,
TEI's /embed, and Cohere's /v2/embed with several embedding_types at once.

binary/ubinary are the float vector's signs packed with ``numpy.packbits``: exactly, when the
floats come from the same request (/v2/embed asks for both at once); across two requests, on
every dimension whose value is not within engine noise of zero (the same text embeds within
cosine 1e-5 alone or in another batch, tests/test_e2e_embeddings.py). int8/uint8 keep the
dimension count and each dimension's order across texts, and read back through the ranges the
ingress calibrated (the same calibration texts embedded here) they correlate with the floats.
"""

from __future__ import annotations

import re

import numpy as np
import openai
import pytest
import requests
from openai import OpenAI
from scipy.stats import pearsonr, spearmanr

from embedfleet.deployments.ingress.calibration_texts import CALIBRATION_TEXTS
from embedfleet.deployments.ingress.encodings import RANGES_HEADER, ranges_of
from tests.conftest import MINILM
from tests.texts import VARIED_TEXTS

pytestmark = pytest.mark.cluster
DIM = 384
NOISE = 1e-3  # |value| below which two requests may disagree on the sign


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def floats(client) -> np.ndarray:
    resp = client.embeddings.create(model=MINILM, input=VARIED_TEXTS, encoding_format="float")
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], np.float32)


@pytest.fixture(scope="module")
def ranges(client) -> np.ndarray:
    """The calibration the ingress runs, run here: its texts' float vectors, min and max."""
    resp = client.embeddings.create(model=MINILM, input=list(CALIBRATION_TEXTS),
                                    encoding_format="float")
    return ranges_of(np.array([d.embedding for d in resp.data], np.float32))


def post(url: str, body: dict) -> requests.Response:
    r = requests.post(url, json=body, timeout=240)
    assert r.status_code == 200, r.text
    return r


def signs_agree(packed: np.ndarray, floats: np.ndarray, offset: int) -> None:
    bits = np.unpackbits((packed.astype(np.int16) + offset).astype(np.uint8), axis=-1)
    assert bits.shape == floats.shape
    clear = np.abs(floats) > NOISE
    np.testing.assert_array_equal(bits.astype(bool)[clear], (floats > 0)[clear])
    assert clear.mean() > 0.9  # the check covers almost every dimension


def read_back(q: np.ndarray, encoding: str, ranges: np.ndarray) -> np.ndarray:
    steps = (ranges[1] - ranges[0]) / 255
    return ranges[0] + (q + (128 if encoding == "int8" else 0) + 0.5) * steps


def check_ranged(q: np.ndarray, encoding: str, floats: np.ndarray, ranges: np.ndarray) -> None:
    assert q.shape == floats.shape == (len(VARIED_TEXTS), DIM)
    lo, hi = (-128, 127) if encoding == "int8" else (0, 255)
    assert q.min() >= lo and q.max() <= hi and (q == np.round(q)).all()
    for j in range(DIM):  # each dimension keeps its order across texts
        assert spearmanr(floats[:, j], q[:, j]).statistic >= 0.98, j
    for f, row in zip(floats, read_back(q, encoding, ranges)):
        assert pearsonr(f, row).statistic >= 0.98


@pytest.mark.parametrize("encoding", ["binary", "ubinary"])
def test_binary_kinds_are_the_signs_packed(client, cluster, floats, encoding):
    offset = 128 if encoding == "binary" else 0
    resp = client.embeddings.create(model=MINILM, input=VARIED_TEXTS, encoding_format=encoding)
    got = np.array([d.embedding for d in resp.data])
    assert got.shape == (len(VARIED_TEXTS), DIM // 8)
    signs_agree(got, floats, offset)
    raw = post(f"{cluster}/v1/embeddings", {"model": MINILM, "input": VARIED_TEXTS,
                                            "encoding_format": encoding})
    data = raw.json()["data"]
    assert all(isinstance(x, int) for d in data for x in d["embedding"])
    np.testing.assert_array_equal(np.array([d["embedding"] for d in data]), got)
    assert RANGES_HEADER not in raw.headers and raw.headers["x-embedfleet-model-digest"]


@pytest.mark.parametrize("encoding", ["int8", "uint8"])
def test_ranged_kinds_keep_dimension_and_order(client, cluster, floats, ranges, encoding):
    raw = client.embeddings.with_raw_response.create(model=MINILM, input=VARIED_TEXTS,
                                                     encoding_format=encoding)
    got = np.array([d.embedding for d in raw.parse().data])
    check_ranged(got, encoding, floats, ranges)
    assert re.fullmatch(r"calibration:[0-9a-f]{16}", raw.headers[RANGES_HEADER])
    plain = post(f"{cluster}/v1/embeddings", {"model": MINILM, "input": VARIED_TEXTS[:3],
                                              "encoding_format": encoding})
    rows = [d["embedding"] for d in plain.json()["data"]]
    assert all(isinstance(x, int) for row in rows for x in row) and len(rows[0]) == DIM
    assert re.fullmatch(r"calibration:[0-9a-f]{16}", plain.headers[RANGES_HEADER])


def test_an_unknown_encoding_is_a_4xx_with_the_error_body(client, cluster):
    with pytest.raises(openai.APIStatusError) as err:
        client.embeddings.create(model=MINILM, input="hello", encoding_format="int4")
    assert 400 <= err.value.status_code < 500
    r = requests.post(f"{cluster}/v1/embeddings", json={
        "model": MINILM, "input": "hello", "encoding_format": "int4"}, timeout=60)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == "encoding_format"
    r = requests.post(f"{cluster}/v2/embed", json={
        "model": MINILM, "texts": ["hello"], "input_type": "search_document",
        "embedding_types": ["float", "int4"]}, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == "embedding_types"


def test_tei_embed_takes_an_encoding(cluster, floats):
    got = np.array(post(f"{cluster}/embed", {"inputs": VARIED_TEXTS,
                                             "encoding_format": "ubinary"}).json())
    signs_agree(got, floats, 0)


def test_cohere_v2_embed_gives_several_types_at_once(cluster, ranges):
    types = ["float", "int8", "uint8", "binary", "ubinary"]
    r = post(f"{cluster}/v2/embed", {"model": MINILM, "texts": VARIED_TEXTS,
                                     "input_type": "search_document", "embedding_types": types})
    body = r.json()
    assert body["texts"] == VARIED_TEXTS and body["id"]
    assert body["meta"]["billed_units"]["input_tokens"] > len(VARIED_TEXTS)
    emb = body["embeddings"]
    assert list(emb) == types
    floats = np.array(emb["float"], np.float32)
    assert floats.shape == (len(VARIED_TEXTS), DIM)
    # the same request's floats: the signs exactly
    bits = np.packbits(floats > 0, axis=-1).astype(np.int16)
    assert emb["ubinary"] == bits.tolist()
    assert emb["binary"] == (bits - 128).tolist()
    for enc in ("int8", "uint8"):
        check_ranged(np.array(emb[enc]), enc, floats, ranges)
    np.testing.assert_array_equal(np.array(emb["int8"]), np.array(emb["uint8"]) - 128)
    assert r.headers[RANGES_HEADER].startswith("calibration:")


def test_the_cohere_sdk_reads_v2_embed(cluster):
    import cohere

    co = cohere.ClientV2(api_key="unused", base_url=cluster, max_retries=0, timeout=240)
    resp = co.embed(model=MINILM, texts=VARIED_TEXTS[:4], input_type="search_query",
                    embedding_types=["float", "binary"])
    floats = np.array(resp.embeddings.float_, np.float32)
    assert floats.shape == (4, DIM) and resp.texts == VARIED_TEXTS[:4]
    bits = np.packbits(floats > 0, axis=-1).astype(np.int16)
    assert resp.embeddings.binary == (bits - 128).tolist()
