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


def ray_batch(**columns) -> dict[str, np.ndarray]:
    """A numpy batch the way Ray Data hands one to a worker (from an Arrow block)."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(pa.table(columns)).to_batch_format("numpy")


def test_a_block_is_sent_in_runs_of_one_prompt_on_the_bulk_lane_skipping_finished_ids():
    router = StandInRouter()
    rows = ray_batch(id=["a", "b", "c", "d", "e"], text=["t1", "t22", "t333", "t4", "t5"],
                     prompt_name=["q", "q", "q", None, "q"])
    out = embedder(router, done=frozenset({"b"}))(rows)
    assert [(c.texts, c.prompt_name, c.lane) for c in router.calls] == [
        (["t1", "t333"], "q", "bulk"), (["t4"], None, "bulk"), (["t5"], "q", "bulk")]
    assert list(out["id"]) == ["a", "c", "d", "e"]
    assert list(out["tokens"]) == [2, 4, 2, 2]
    assert out["embedding"][:, 0].tolist() == [1, 1, 2, 3]  # each row its own call's vector
    assert set(out["fingerprint"]) == {"abc/float32/vllm/cpu"}


def test_a_refused_batch_is_retried_after_its_retry_after_and_a_rejected_text_stops_the_job():
    router = StandInRouter([Overloaded("bulk queue full", retry_after_s=0.01)])
    rows = ray_batch(id=[7, 8], text=["x", "y"])
    out = embedder(router)(rows)
    assert len(router.calls) == 2 and list(out["id"]) == [7, 8]

    router = StandInRouter([InputTooLong("input[1] has 900 tokens", param="input")])
    with pytest.raises(ec.CorpusError, match=r"row id 8 was refused \(400 "
                                             r"context_length_exceeded\): input\[1\] has 900"):
        embedder(router)(rows)


def test_missing_values_as_ray_data_types_them_never_reach_the_fleet():
    # A JSONL block whose prompt_name is null on every row: Ray Data hands it as float NaN.
    rows = ray_batch(id=[1, 2], text=["x", "y"], prompt_name=pa_nulls(2))
    router = StandInRouter()
    embedder(router)(rows)
    assert [c.prompt_name for c in router.calls] == [None]
    with pytest.raises(ec.CorpusError, match=r"row id 2 has no text"):
        embedder(StandInRouter())(ray_batch(id=[1, 2], text=["x", None]))
    with pytest.raises(ec.CorpusError, match="a row has no id"):
        embedder(StandInRouter())(ray_batch(id=["a", None], text=["x", "y"]))


def pa_nulls(n: int):
    import pyarrow as pa

    return pa.nulls(n)


def test_the_reason_a_worker_stopped_the_job_reaches_the_user():
    try:
        try:
            raise ec.CorpusError("row id 'x' has no text")
        except ec.CorpusError as err:
            raise RuntimeError("UserCodeException") from err
    except RuntimeError as wrapped:
        assert ec.corpus_error(wrapped) == "row id 'x' has no text"
    # Ray keeps only the text of a remote cause: the last CorpusError line is the reason.
    remote = RuntimeError("ray::MapWorker() (pid=1)\n  File ...\nembedfleet.cluster."
                          "embed_corpus.CorpusError: the batch starting at id 7 was refused\n")
    assert ec.corpus_error(remote) == "the batch starting at id 7 was refused"
    assert ec.corpus_error(ValueError("a bug")) is None
