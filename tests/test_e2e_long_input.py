"""Long inputs (reject / truncate / chunk), length-aware batching, instructions, Matryoshka
dimensions and TEI's /embed and /tokenize, end to end."""

from __future__ import annotations

import random

import numpy as np
import pytest
import requests

from embedfleet.deployments.common.long_input import LongInputPolicy, SpecialTokens, plan
from tests.texts import doc
from tests.conftest import MINILM, TINY_QWEN3

pytestmark = pytest.mark.cluster


def post(cluster, path="/v1/embeddings", **body):
    return requests.post(f"{cluster}{path}", json=body, timeout=300)


def vecs(resp) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    return np.array([d["embedding"] for d in resp.json()["data"]], np.float32)


def cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def long_doc(minilm_tokenizer) -> tuple[str, list[int]]:
    text = doc(3000, seed=1)
    ids = minilm_tokenizer(text)["input_ids"]
    assert 2900 <= len(ids) <= 3200
    return text, ids


def test_chunk_equals_weighted_mean_of_independently_embedded_chunks(cluster, long_doc,
                                                                     minilm_tokenizer):
    text, ids = long_doc
    resp = post(cluster, model=MINILM, input=[text], long_input="chunk", encoding_format="float")
    got = vecs(resp)[0]
    assert abs(np.linalg.norm(got) - 1) < 1e-4
    (info,) = resp.json()["embedfleet"]["inputs"]
    # independently: the same windows, each embedded as token ids, merged by token count
    p = plan(ids, 256, LongInputPolicy(mode="chunk"), SpecialTokens.from_tokenizer(minilm_tokenizer))
    assert info["chunks"] == len(p.pieces) >= 12 and info["truncated"] is False
    chunk_vecs = vecs(post(cluster, model=MINILM, input=p.pieces, encoding_format="float"))
    merged = (chunk_vecs * np.array(p.weights, np.float32)[:, None]).sum(0)
    merged /= np.linalg.norm(merged)
    assert cos(got, merged) >= 0.9999
    assert resp.headers["x-embedfleet-chunked-inputs"] == "1"


def test_truncate_equals_first_256_tokens_and_reject_names_both_lengths(cluster, long_doc):
    text, ids = long_doc
    resp = post(cluster, model=MINILM, input=text, long_input="truncate", encoding_format="float")
    got = vecs(resp)[0]
    (info,) = resp.json()["embedfleet"]["inputs"]
    assert info["truncated"] is True and info["dropped_tokens"] == len(ids) - 256
    first_256 = ids[:255] + [ids[-1]]  # [CLS] + 254 words ... + [SEP]: what the model sees
    ref = vecs(post(cluster, model=MINILM, input=first_256, encoding_format="float"))[0]
    assert cos(got, ref) >= 0.99999
    left = vecs(post(cluster, model=MINILM, input=text, long_input="truncate",
                     truncation_direction="left", encoding_format="float"))[0]
    assert cos(left, got) < 0.999  # kept the end instead
    rejected = post(cluster, model=MINILM, input=text, long_input="reject")
    assert rejected.status_code == 400
    msg = rejected.json()["error"]["message"]
    assert str(len(ids)) in msg and "256" in msg


def test_tiny_qwen3_embeds_a_32k_token_input_with_chunk(cluster, minilm_tokenizer):
    text = doc(33000, seed=2)
    n = len(minilm_tokenizer(text)["input_ids"])
    assert n >= 32768
    text = minilm_tokenizer.decode(minilm_tokenizer(text)["input_ids"][1:32767])
    resp = post(cluster, model=TINY_QWEN3, input=text, long_input="chunk",
                encoding_format="float")
    v = vecs(resp)[0]
    assert v.shape == (128,) and abs(np.linalg.norm(v) - 1) < 1e-4
    assert resp.json()["embedfleet"]["inputs"][0]["chunks"] >= 8
    assert resp.json()["usage"]["prompt_tokens"] >= 32000


def test_mixed_batch_of_200_keeps_order_and_matches_single_requests(cluster, tiny_qwen3_dir):
    """Issue 5's batch on the tiny Qwen3 (4,096 positions: every input fits, so this is the
    length-aware batching of the batch, not chunking; the chunk tests above cover that). On
    MiniLM (256 positions) the same batch was ~633 chunks, 78 s of two shared cores alone, and
    a CI run on a starved machine cut it at the router's bound."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    rng = random.Random(3)
    # lengths log-uniform from 5 to 3,000 tokens, both ends included
    words = [3, 2840] + [int(np.exp(rng.uniform(np.log(3), np.log(2840)))) for _ in range(198)]
    rng.shuffle(words)
    texts = [doc(n, seed=100 + i) for i, n in enumerate(words)]
    lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    assert min(lengths) == 5 and 2980 <= max(lengths) <= 3020, (min(lengths), max(lengths))
    resp = post(cluster, model=TINY_QWEN3, input=texts, encoding_format="float")
    batch = vecs(resp)
    assert batch.shape == (200, 128)
    assert resp.json()["usage"]["prompt_tokens"] == sum(lengths)

    def single(t):
        return vecs(post(cluster, model=TINY_QWEN3, input=t, encoding_format="float"))[0]

    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(8) as pool:  # concurrent: other batches than the big one's
        singles = list(pool.map(single, texts))
    for i, v in enumerate(singles):
        assert cos(v, batch[i]) >= 0.99999, i


def test_instruction_template_changes_query_vector_and_counts_in_usage(cluster, minilm_tokenizer):
    q = "what is the limitation period for a tort claim?"
    plain = post(cluster, model=TINY_QWEN3, input=q, encoding_format="float")
    prompted = post(cluster, model=TINY_QWEN3, input=q, prompt_name="query",
                    encoding_format="float")
    assert cos(vecs(plain)[0], vecs(prompted)[0]) < 0.999
    instruction = ("Instruct: Given a web search query, retrieve relevant passages that answer "
                   "the query\nQuery:")
    expected = len(minilm_tokenizer(instruction + q)["input_ids"])
    assert prompted.json()["usage"]["prompt_tokens"] == expected
    assert expected > plain.json()["usage"]["prompt_tokens"]
    bad = post(cluster, model=TINY_QWEN3, input=q, prompt_name="nope")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_name"


def test_matryoshka_dimensions_where_declared(cluster):
    full = vecs(post(cluster, model=TINY_QWEN3, input="dimensions", encoding_format="float"))[0]
    small = vecs(post(cluster, model=TINY_QWEN3, input="dimensions", dimensions=64,
                      encoding_format="float"))[0]
    assert small.shape == (64,) and abs(np.linalg.norm(small) - 1) < 1e-4
    assert cos(small, full[:64]) >= 0.99999
    bad = post(cluster, model=TINY_QWEN3, input="x", dimensions=48)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    minilm = post(cluster, model=MINILM, input="x", dimensions=64)
    assert minilm.status_code == 400 and "does not support" in minilm.json()["error"]["message"]


def test_tei_embed_shape_normalize_and_truncate(cluster, reference_embed, long_doc):
    r = post(cluster, "/embed", inputs="The quick brown fox")
    body = r.json()
    assert r.status_code == 200 and isinstance(body, list) and len(body) == 1
    v = np.array(body[0], np.float32)
    assert v.shape == (384,) and cos(v, reference_embed(["The quick brown fox"])[0]) >= 0.999
    raw = np.array(post(cluster, "/embed", inputs=["a cat"], normalize=False).json()[0])
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # the pooler's raw output
    text, _ = long_doc
    assert post(cluster, "/embed", inputs=[text], truncate=False).status_code == 400
    cut = post(cluster, "/embed", inputs=[text], truncate=True)
    assert cut.status_code == 200 and cut.headers["x-embedfleet-truncated-inputs"] == "1"
    assert post(cluster, "/embed", inputs=[]).status_code == 422


def test_tei_tokenize_matches_the_model_tokenizer(cluster, minilm_tokenizer):
    text = "Embeddings, at scale!"
    r = post(cluster, "/tokenize", inputs=[text])
    assert r.status_code == 200
    (tokens,) = r.json()
    assert [t["id"] for t in tokens] == minilm_tokenizer(text)["input_ids"]
    assert tokens[0]["special"] is True and tokens[1]["special"] is False
    word = tokens[1]
    assert text[word["start"]:word["stop"]] == word["text"] == "Em"  # TEI: the input's slice
