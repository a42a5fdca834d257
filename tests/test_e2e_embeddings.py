"""End to end through HTTP with the real `openai` client against the session cluster."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import requests
from openai import OpenAI

from tests.conftest import MINILM
from tests.texts import VARIED_TEXTS

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_vectors_match_transformers_reference(client, reference_embed):
    resp = client.embeddings.create(model=MINILM, input=VARIED_TEXTS, encoding_format="float")
    got = vectors(resp)
    assert got.shape == (len(VARIED_TEXTS), 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    cos = cosine(got, reference_embed(VARIED_TEXTS))
    assert cos.min() >= 0.999, {t[:30]: round(float(c), 6) for t, c in zip(VARIED_TEXTS, cos)}
    assert resp.model == MINILM and resp.object == "list"


def test_base64_default_of_openai_client_decodes_to_same_vectors(client, cluster):
    # The openai client asks for base64 when encoding_format is not given, and decodes it.
    as_b64 = vectors(client.embeddings.create(model=MINILM, input=VARIED_TEXTS[:5]))
    as_float = vectors(client.embeddings.create(model=MINILM, input=VARIED_TEXTS[:5],
                                                encoding_format="float"))
    np.testing.assert_allclose(as_b64, as_float, atol=1e-6)
    raw = requests.post(f"{cluster}/v1/embeddings", json={
        "model": MINILM, "input": "hello world", "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (384,)
    np.testing.assert_allclose(decoded, as_float[0], atol=1e-6)


def test_usage_counts_real_tokens(client, minilm_tokenizer):
    texts = VARIED_TEXTS[:8]
    resp = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    expected = sum(len(minilm_tokenizer(t)["input_ids"]) for t in texts)
    assert resp.usage.prompt_tokens == expected
    assert resp.usage.total_tokens == expected


def test_single_string_and_token_id_inputs(client, minilm_tokenizer):
    text = "Token ids give the same vector as the text."
    ids = minilm_tokenizer(text)["input_ids"]
    one = vectors(client.embeddings.create(model=MINILM, input=text, encoding_format="float"))
    flat = client.embeddings.create(model=MINILM, input=ids, encoding_format="float")
    nested = client.embeddings.create(model=MINILM, input=[ids, ids[:5]],
                                      encoding_format="float")
    assert one.shape == (1, 384) and len(flat.data) == 1 and len(nested.data) == 2
    assert cosine(vectors(flat)[0], one[0]) >= 0.99999
    assert cosine(vectors(nested)[0], one[0]) >= 0.99999
    assert flat.usage.prompt_tokens == len(ids)
    assert nested.usage.prompt_tokens == len(ids) + 5


def test_batch_composition_invariance(client):
    rng = random.Random(7)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    filler = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(63)]
    probe = "The same text alone and inside a batch must embed identically."
    batch = filler[:31] + [probe] + filler[31:]
    alone = vectors(client.embeddings.create(model=MINILM, input=probe, encoding_format="float"))
    inside = vectors(client.embeddings.create(model=MINILM, input=batch, encoding_format="float"))
    assert len(inside) == 64
    assert cosine(alone[0], inside[31]) >= 0.99999
    # and each filler text too, against its own single-request vector (results stay in order)
    for i in (0, 17, 40, 63):
        single = vectors(client.embeddings.create(model=MINILM, input=batch[i],
                                                  encoding_format="float"))
        assert cosine(single[0], inside[i]) >= 0.99999, i


def test_large_request_spread_over_slices_keeps_order(client, reference_embed):
    texts = [f"document number {i}: " + "word " * (i % 37) for i in range(300)]
    got = vectors(client.embeddings.create(model=MINILM, input=texts, encoding_format="float"))
    ref = reference_embed(texts)
    assert got.shape == (300, 384)
    assert cosine(got, ref).min() >= 0.999
