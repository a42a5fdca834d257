"""`embedfleet embed-corpus` on the live cluster: 10,000 texts through the serving fleet on the bulk
lane (a Ray Data job), killed midway and run again. The output holds exactly the input's ids, once
each, and its vectors, token counts and fingerprint are the online API's.

Throughput is printed (texts/s of each run), not asserted: this machine's noise would make a timed
assertion flaky; the figure of record is in the README's "Bulk embedding" section.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import requests

# 1 to 6 words (~8 to 25 tokens): short, so 10,000 of them take ~2 minutes on this machine; the
# same texts the corpus bench measures (benchmarks/corpus_bench.py)
from embedfleet.benchmarks.corpus_bench import corpus_text
from tests.conftest import EMBEDFLEET, MINILM, ROOT, TINY_QWEN3

pytestmark = pytest.mark.cluster
ROWS = 10_000




def start_job(src, out, *extra: str, model: str = MINILM) -> subprocess.Popen:
    return subprocess.Popen(
        [EMBEDFLEET, "embed-corpus", str(src), "--model", model, "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "token"}, start_new_session=True)


def rows_in(out) -> int:
    return sum(pq.read_metadata(p).num_rows for p in out.glob("part-*.parquet"))


def bulk_admitted_per_card(cluster) -> dict[tuple[str, str], int]:
    data = requests.get(f"{cluster}/v1/models", timeout=30).json()["data"]
    cards = next(m for m in data if m["id"] == MINILM)["replicas"]["cards"]
    return {(c["node"], c["device"]): c["budget"]["admitted_bulk_total"] for c in cards}


def test_a_killed_corpus_job_resumes_to_exactly_every_id_with_the_online_vectors(
        cluster, tmp_path, minilm_tokenizer):
    src, out = tmp_path / "corpus.jsonl", tmp_path / "vectors"
    with src.open("w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"id": f"doc-{i:05d}", "text": corpus_text(i)}) + "\n")
    before = bulk_admitted_per_card(cluster)
    assert len({node for node, _ in before}) == 2, before  # MiniLM x 2, one per node

    # 1. Killed midway: SIGKILL of the job's driver (its Ray Data workers die with it).
    job = start_job(src, out)  # 64 x 2 = 128-row parts: many to resume from
    deadline = time.monotonic() + 300
    while rows_in(out) < 1024 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.poll() is None, f"the job ended before it could be killed: {job.stderr.read()}"
    os.killpg(job.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    _, err = job.communicate(timeout=60)
    print(f"killed run reaped in {time.monotonic() - t_kill:.1f}s")
    first = rows_in(out)
    assert 0 < first < ROWS, (first, err[-3000:])

    # 2. Run again: only the rest is sent, and the job finishes.
    t_rerun = time.monotonic()
    job = start_job(src, out)
    stdout, err = job.communicate(timeout=900)
    print(f"rerun took {time.monotonic() - t_rerun:.1f}s")
    assert job.returncode == 0, err[-3000:]
    assert "rows in this run" in stdout, stdout
    print(stdout.strip().splitlines()[-1], f"(first run, killed: {first} rows)")
    assert not list(out.glob(".*.tmp")), "a temporary part was left behind"

    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == ROWS and len(set(ids)) == ROWS, (len(ids), len(set(ids)))
    assert set(ids) == {f"doc-{i:05d}" for i in range(ROWS)}
    # the rerun sent only what the killed run had not finished
    assert f"embedded {ROWS - first:,} rows in this run" in stdout, (first, stdout)

    # It went through the bulk lane of every replica, on both nodes.
    after = bulk_admitted_per_card(cluster)
    assert all(after[card] > before[card] for card in before), (before, after)

    # 3. The online API's vectors, token counts and fingerprint, on a sample.
    by_id = {i: k for k, i in enumerate(ids)}
    sample = list(range(0, ROWS, 211))
    texts = [corpus_text(i) for i in sample]
    resp = requests.post(f"{cluster}/v1/embeddings", timeout=120,
                         json={"model": MINILM, "input": texts, "encoding_format": "float"})
    assert resp.status_code == 200, resp.text
    online = np.asarray([d["embedding"] for d in resp.json()["data"]], dtype=np.float32)
    stored = np.stack([np.asarray(table.column("embedding")[by_id[f"doc-{i:05d}"]].as_py(),
                                  dtype=np.float32) for i in sample])
    assert stored.shape == online.shape == (len(sample), 384)
    cos = (stored * online).sum(1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(online, axis=1)
    assert cos.min() >= 0.99999, cos.min()
    tokens = table.column("tokens").to_pylist()
    want = [len(x) for x in minilm_tokenizer(texts)["input_ids"]]
    assert [tokens[by_id[f"doc-{i:05d}"]] for i in sample] == want
    prints = set(table.column("fingerprint").to_pylist())
    assert prints == {"/".join(resp.headers[f"x-embedfleet-{k}"] for k in
                               ("model-digest", "dtype", "engine", "platform"))}, prints


def test_a_text_the_model_rejects_stops_the_job_naming_its_id(cluster, tmp_path):
    # tiny-qwen3 rejects inputs over its 4,096 positions (long_input.mode: reject).
    src = tmp_path / "corpus.jsonl"
    rows = [{"id": "short-1", "text": "a short passage"},
            {"id": "far-too-long", "text": "word " * 6000},
            {"id": "short-2", "text": "another short passage", "prompt_name": "query"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = start_job(src, tmp_path / "vectors", model=TINY_QWEN3)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 2, err[-3000:]
    assert "error: row id 'far-too-long' was refused (400 context_length_exceeded)" in err, \
        err[-3000:]
    assert "Traceback" not in err, err[-3000:]
