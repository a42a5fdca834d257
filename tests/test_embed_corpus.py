"""The corpus job's parts without a cluster: input discovery, finished parts and their
fingerprints, whole-or-absent writes, the batching by prompt and the retry/stop rules of a call.

The Router's Serve handle is replaced by a stand-in (``StandInRouter``) that answers or raises what
the real one raises; the live job runs in tests/test_e2e_corpus.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedfleet.cluster import embed_corpus as ec
from embedfleet.deployments.contracts import BatchResult
from embedfleet.deployments.errors import InputTooLong, Overloaded

PRINT = {"x-embedfleet-model-digest": "abc", "x-embedfleet-dtype": "float32",
         "x-embedfleet-engine": "vllm", "x-embedfleet-platform": "cpu"}


def batch(ids, fingerprint="abc/float32/vllm/cpu", dim=4):
    n = len(ids)
    return {"id": np.asarray(ids, dtype=object),
            "embedding": np.arange(n * dim, dtype=np.float32).reshape(n, dim),
            "tokens": np.arange(n, dtype=np.int64) + 3,
            "fingerprint": np.asarray([fingerprint] * n, dtype=object)}


def test_input_files_take_one_kind_and_name_what_they_found(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    kind, files = ec.input_files(tmp_path)
    assert kind == "json" and [f.rsplit("/", 1)[1] for f in files] == ["a.jsonl", "b.jsonl"]
    (tmp_path / "c.parquet").write_bytes(b"")
    with pytest.raises(ec.CorpusError, match="one kind"):
        ec.input_files(tmp_path)
    with pytest.raises(ec.CorpusError, match="notes.txt"):
        (tmp_path / "notes.txt").write_text("x")
        ec.input_files(tmp_path / "notes.txt")


def test_parts_are_whole_and_their_ids_and_fingerprint_are_read_back(tmp_path):
    assert ec.write_part(tmp_path, batch(["a", "b"])) == 2
    assert ec.write_part(tmp_path, batch(["c"])) == 1
    assert ec.write_part(tmp_path, batch([])) == 0  # nothing left to write: no empty part
    assert not list(tmp_path.glob(".*"))  # renamed, no temporary left
    done, fingerprint = ec.finished_ids(tmp_path)
    assert done == {"a", "b", "c"} and fingerprint == "abc/float32/vllm/cpu"
    table = pq.read_table(tmp_path)
    assert table.schema.field("embedding").type.list_size == 4
    assert sorted(table.column("tokens").to_pylist()) == [3, 3, 4]

    ec.write_part(tmp_path, batch(["d"], fingerprint="zzz/float32/vllm/cpu"))
    with pytest.raises(ec.CorpusError, match="several fingerprints"):
        ec.finished_ids(tmp_path)


class StandInRouter:
    """Stands in for the Router's Serve handle: ``embed_batch.remote(call).result()``."""

    def __init__(self, failures=()):
        self.failures = list(failures)
        self.calls = []
        self.embed_batch = self

    def remote(self, call):
        self.calls.append(call)
        return self

    def result(self):
        if self.failures:
            raise self.failures.pop(0)
        call = self.calls[-1]
        return BatchResult(np.full((len(call.texts), 4), len(self.calls), np.float32),
                           tuple(len(t) for t in call.texts), PRINT)


def embedder(router, batch_size=2, done=frozenset()):
    e = ec.BatchEmbedder.__new__(ec.BatchEmbedder)
    e.settings = ec.JobSettings("app", "m", batch_size, 2, max_retry_s=5)
    e.done, e.router = done, router
    import concurrent.futures as cf
    e.pool = cf.ThreadPoolExecutor(1)  # one at a time: the stand-in's answers follow call order
    return e


def test_a_block_is_sent_in_runs_of_one_prompt_on_the_bulk_lane_skipping_finished_ids():
    router = StandInRouter()
    rows = {"id": np.asarray(["a", "b", "c", "d", "e"], dtype=object),
            "text": np.asarray(["t1", "t22", "t333", "t4", "t5"], dtype=object),
            "prompt_name": np.asarray(["q", "q", "q", None, "q"], dtype=object)}
    out = embedder(router, done=frozenset({"b"}))(rows)
    assert [(c.texts, c.prompt_name, c.lane) for c in router.calls] == [
        (["t1", "t333"], "q", "bulk"), (["t4"], None, "bulk"), (["t5"], "q", "bulk")]
    assert list(out["id"]) == ["a", "c", "d", "e"]
    assert list(out["tokens"]) == [2, 4, 2, 2]
    assert out["embedding"][:, 0].tolist() == [1, 1, 2, 3]  # each row its own call's vector
    assert set(out["fingerprint"]) == {"abc/float32/vllm/cpu"}


def test_a_refused_batch_is_retried_after_its_retry_after_and_a_rejected_text_stops_the_job():
    router = StandInRouter([Overloaded("bulk queue full", retry_after_s=0.01)])
    rows = {"id": np.asarray([7, 8], dtype=object), "text": np.asarray(["x", "y"], dtype=object)}
    out = embedder(router)(rows)
    assert len(router.calls) == 2 and list(out["id"]) == [7, 8]

    router = StandInRouter([InputTooLong("input has 900 tokens", param="input")])
    with pytest.raises(ec.CorpusError, match=r"starting at id 7 was refused \(400 "
                                             r"context_length_exceeded\): input has 900"):
        embedder(router)(rows)
