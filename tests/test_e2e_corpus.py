"""`embedfleet embed-corpus` on the live cluster, on a corpus the way real ones are: a few texts
over MiniLM's 256 tokens, empty and non-string texts, a line that is not JSON, a row without an
id, an id on two rows, a prompt name the model has no template for.

* Under each ``--long-input`` value, and across a SIGKILL of the job and a resume, every input
  row ends in exactly one place: a Parquet part or ``errors.jsonl``, never both, never neither.
* Exit status: 2 when the job finished with refused rows, 0 when every row was embedded, 1 when
  it could not finish (here: a second job on the same --out while the first runs).
* The stored vectors, token counts and fingerprint are the online API's, under the same
  long-input mode; the job's calls went through the bulk lane of both MiniLM replicas.
* Rows whose text holds U+2028, U+2029 or U+0085 raw (legal in a JSON string) arrive whole: JSON
  Lines ends a row at "\n" only (issue 39).

A few hundred rows each: the job's correctness, not its speed (the corpus bench measures that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import requests

# short texts (~8 to 25 tokens), the ones the corpus bench measures (benchmarks/corpus_bench.py)
from embedfleet.benchmarks.corpus_bench import corpus_text
from tests.conftest import EMBEDFLEET, MINILM, ROOT

pytestmark = pytest.mark.cluster
WORDS = ("court contract statute appeal remedy damages tort negligence liability clause party "
         "breach evidence witness judgment precedent jurisdiction tribunal").split()
# Rows the job refuses whatever the mode, by row index: (what the row is, its code)
BAD_ROWS = {11: ("empty", "empty_text"), 23: ("spaces", "empty_text"),
            31: ("number", "non_string_text"), 45: ("not json", "invalid_json"),
            52: ("no id", "missing_id"), 60: ("id of row 3", "duplicate_id"),
            66: ("prompt_name", "unsupported_parameter")}


def long_text(i: int) -> str:
    """~400 tokens: over MiniLM's 256."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(400))


def is_long(i: int) -> bool:
    return i % 40 == 7


SEPARATED = (13, 63, 113)  # rows whose text holds characters str.splitlines breaks at
SEPARATORS = ("\u2028", "\u2029", "\x85")


def row_text(i: int) -> str:
    if is_long(i):
        return long_text(i)
    if i in SEPARATED:
        return SEPARATORS[SEPARATED.index(i)].join((corpus_text(i), corpus_text(i + 1)))
    return corpus_text(i)


def doc_id(i: int) -> str:
    return f"doc-{i:04d}"


def write_corpus(path, n: int, bad: bool = True) -> None:
    lines = []
    for i in range(n):
        row = {"id": doc_id(i), "text": row_text(i)}
        what = BAD_ROWS.get(i, ("",))[0] if bad else ""
        if what == "not json":
            lines.append('{"id": "doc-broken", "text": "cut here')
            continue
        row.update({"empty": {"text": ""}, "spaces": {"text": "   "}, "number": {"text": 42},
                    "no id": {"id": None}, "id of row 3": {"id": doc_id(3)},
                    "prompt_name": {"prompt_name": "query"}}.get(what, {}))
        lines.append(json.dumps(row, ensure_ascii=False))  # separators raw, as JSON allows
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def start_job(src, out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [EMBEDFLEET, "embed-corpus", str(src), "--model", MINILM, "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "token"}, start_new_session=True)


def parts_of(out) -> list:
    return sorted(out.glob("part-*.parquet"))


def rows_in(out) -> int:
    return sum(pq.read_metadata(p).num_rows for p in parts_of(out))


def errors_of(out) -> list[dict]:
    path = out / "errors.jsonl"
    whole = path.read_text().split("\n")[:-1] if path.exists() else []  # (one being written)
    return [json.loads(x) for x in whole]


def check_every_row_once(out, n: int, long_refused: bool, bad: bool = True) -> dict[str, int]:
    """Every one of the n rows in exactly one place; returns the parts' id -> row position."""
    ids = pq.read_table(parts_of(out)).column("id").to_pylist()
    errors = errors_of(out)
    assert len(ids) == len(set(ids)), "an id is in two parts"
    assert len(ids) + len(errors) == n, (len(ids), len(errors), n)
    refused = Counter(e["code"] for e in errors)
    want = Counter(code for _, code in BAD_ROWS.values()) if bad else Counter()
    if bad:
        want["duplicate_id"] += 1  # the id's other row (row 3) is refused too
    if long_refused:  # (no long row is one of BAD_ROWS)
        want["context_length_exceeded"] += sum(is_long(i) for i in range(n))
    assert refused == want, (refused, want)
    keyed = {e["id"] for e in errors if e["id"] is not None}
    assert not keyed & set(ids), "a row in both a part and errors.jsonl"
    if bad:
        assert {e["id"]: e["code"] for e in errors if e["code"] == "duplicate_id"} == {
            doc_id(3): "duplicate_id"}
        assert all(e["row"] for e in errors if e["code"] in ("invalid_json", "missing_id",
                                                               "duplicate_id"))
    return {x: k for k, x in enumerate(ids)}


def bulk_admitted_per_card(cluster) -> dict[tuple[str, str], int]:
    data = requests.get(f"{cluster}/v1/models", timeout=30).json()["data"]
    cards = next(m for m in data if m["id"] == MINILM)["replicas"]["cards"]
    return {(c["node"], c["device"]): c["budget"]["admitted_bulk_total"] for c in cards}


def check_online_vectors(cluster, out, index: dict[str, int], rows: list[int],
                         mode: str | None, minilm_tokenizer=None) -> None:
    """The stored vectors of ``rows`` are /v1/embeddings's under the same long-input mode."""
    table = pq.read_table(parts_of(out))
    texts = [row_text(i) for i in rows]
    body = {"model": MINILM, "input": texts, "encoding_format": "float"}
    resp = requests.post(f"{cluster}/v1/embeddings", timeout=120,
                         json={**body, **({"long_input": mode} if mode else {})})
    assert resp.status_code == 200, resp.text
    online = np.asarray([d["embedding"] for d in resp.json()["data"]], np.float32)
    stored = np.stack([np.asarray(table.column("embedding")[index[doc_id(i)]].as_py(),
                                  np.float32) for i in rows])
    assert stored.shape == online.shape == (len(rows), 384)
    cos = (stored * online).sum(1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(online,
                                                                                    axis=1)
    assert cos.min() >= 0.99999, cos.min()
    prints = set(table.column("fingerprint").to_pylist())
    assert prints == {"/".join(resp.headers[f"x-embedfleet-{k}"] for k in
                               ("model-digest", "dtype", "engine", "platform"))}, prints
    if minilm_tokenizer is not None:  # each text's own length, before any cut
        want = [len(x) for x in minilm_tokenizer(texts)["input_ids"]]
        tokens = table.column("tokens").to_pylist()
        assert [tokens[index[doc_id(i)]] for i in rows] == want


def test_a_killed_job_on_a_real_corpus_resumes_to_every_row_exactly_once(
        cluster, tmp_path, minilm_tokenizer):
    n = 600
    src, out = tmp_path / "corpus.jsonl", tmp_path / "vectors"
    write_corpus(src, n)
    before = bulk_admitted_per_card(cluster)
    assert len({node for node, _ in before}) == 2, before  # MiniLM x 2, one per node

    # 1. The model's own policy (MiniLM's: reject); parts of 8 rows, so there is time to kill.
    job = start_job(src, out, "--batch-size", "8", "--inflight", "1")
    deadline = time.monotonic() + 120
    while not (out / ".lock").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # One writer per --out: a second job on the folder is refused at once, naming the first
    # (which takes its lock before it connects to Ray, so it is still starting or running).
    second = start_job(src, out)
    _, err2 = second.communicate(timeout=120)
    assert second.returncode == 1, err2[-3000:]
    assert f"another embed-corpus job writes to {out} (pid {job.pid}" in err2, err2[-3000:]
    deadline = time.monotonic() + 300
    while len(parts_of(out)) < 3 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, f"the job ended before it could be killed: {job.stderr.read()}"
    # Ids are checked while reading, before any call: both rows of the repeated id are refused
    # already, though the job has done only a few parts.
    assert sum(e["code"] == "duplicate_id" for e in errors_of(out)) == 2
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=60)
    first = rows_in(out)
    assert 0 < first < n - 50, first
    killed = job.pid
    assert json.loads((out / ".lock").read_text())["pid"] == killed  # left by the killed job

    # 2. Run again: the dead job's lock is taken over, only the undecided rows are sent.
    job = start_job(src, out, "--batch-size", "8", "--inflight", "1")
    stdout, err = job.communicate(timeout=900)
    assert job.returncode == 2, err[-3000:]  # finished, with refused rows
    assert f"took over the lock of pid {killed}" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not list(out.glob(".*.tmp")) and not (out / ".lock").exists()
    index = check_every_row_once(out, n, long_refused=True)
    assert f"embedded {len(index) - first:,} rows in this run" in stdout, (first, stdout)
    errors = errors_of(out)
    assert (f"{len(index):,} of {n:,} rows embedded and {len(errors):,} refused "
            "(context_length_exceeded ") in stdout, stdout
    long_error = next(e for e in errors if e["code"] == "context_length_exceeded")
    assert "256" in long_error["message"] and long_error["id"] in {
        doc_id(i) for i in range(n) if is_long(i)}

    # It went through the bulk lane of every replica, on both nodes.
    after = bulk_admitted_per_card(cluster)
    assert all(after[card] > before[card] for card in before), (before, after)
    sample = [i for i in range(0, n, 37) if i not in BAD_ROWS and i != 3 and not is_long(i)]
    sample += SEPARATED  # whole, as the online API embeds the same text
    check_online_vectors(cluster, out, index, sample, None, minilm_tokenizer)


@pytest.mark.parametrize("mode", ["truncate", "chunk", "reject"])
def test_each_long_input_mode_finishes_with_every_row_in_one_place(cluster, tmp_path, mode):
    n = 120
    src, out = tmp_path / "corpus.jsonl", tmp_path / "vectors"
    write_corpus(src, n)
    job = start_job(src, out, "--long-input", mode)
    stdout, err = job.communicate(timeout=600)
    assert job.returncode == 2, err[-3000:]  # the invalid rows are refused in every mode
    assert "Traceback" not in err, err[-3000:]
    index = check_every_row_once(out, n, long_refused=mode == "reject")
    longs = [i for i in range(n) if is_long(i)]
    if mode == "reject":
        assert not {doc_id(i) for i in longs} & set(index)
        check_online_vectors(cluster, out, index, [0, 1, 2, 4, *SEPARATED], None)
    else:  # the long rows embedded as the online API embeds them in that mode
        check_online_vectors(cluster, out, index, [0, *longs, *SEPARATED], mode)


def test_a_clean_corpus_with_long_texts_exits_0_under_truncate(cluster, tmp_path):
    n = 50
    src, out = tmp_path / "corpus.jsonl", tmp_path / "vectors"
    write_corpus(src, n, bad=False)
    job = start_job(src, out, "--long-input", "truncate")
    stdout, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    check_every_row_once(out, n, long_refused=False, bad=False)
    assert not (out / "errors.jsonl").exists()
    assert f"holds {n} of {n} rows embedded and 0 refused" in stdout, stdout
    # The same corpus under the model's policy (reject): the long rows are refused, exit 2.
    job = start_job(src, tmp_path / "rejected")
    stdout, err = job.communicate(timeout=600)
    assert job.returncode == 2, err[-3000:]
    codes = Counter(e["code"] for e in errors_of(tmp_path / "rejected"))
    assert codes == {"context_length_exceeded": sum(is_long(i) for i in range(n))}, codes
