"""STAND-INS for the corpus job's unit tests: the app's Serve handle, and Ray Data run in process.

``StandInHandle`` answers ``embed_batch.remote(call).result()`` the way the fleet does for what
the job relies on: a text's length in tokens is its word count + 2 (the BERT wrapper); a text
over ``max_len`` tokens is refused under ``reject`` with the replica's own message (``input[k]
has N tokens, more than the model's maximum context length ...``, the first such input of the
call, as the replica plans inputs in order), and over ``max_total`` tokens in every mode; a call
over ``max_chars`` characters in all is refused as a whole (413, naming no input, as the
pipeline's request bound is); ``chunk_above`` outside chunk mode is a 400 naming no input. A vector tells its text and the mode that embedded it apart:
``[words, chars, mode index, 1]``. ``failures`` are raised first, one per call.

``in_process_rest`` replaces ``embed_corpus._embed_rest`` (Ray Data, the worker pool) with the
same steps in this process: the input read as ``read_binary_files`` + ``jsonl_block`` /
``read_parquet`` would hand it, in
blocks of one part's rows, each through a ``BatchEmbedder`` on the stand-in handle, each result
taken by the real ``take_block``. ``kill_after`` blocks, it raises ``Killed`` as a SIGKILL of
the driver would stop the job: after the last whole block was taken.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

import numpy as np

from embedfleet.cluster import embed_corpus as ec
from embedfleet.cluster.corpus_out import take_block
from embedfleet.deployments.common.contracts import BatchResult
from embedfleet.deployments.common.errors import (InputTooLong, InvalidParameterValue,
                                                   RequestTooLarge)

PRINT = {"x-embedfleet-model-digest": "abc", "x-embedfleet-dtype": "float32",
         "x-embedfleet-engine": "vllm", "x-embedfleet-platform": "cpu"}
FINGERPRINT = "abc/float32/vllm/cpu"
MODES = ("reject", "truncate", "chunk")


def tokens_of(text: str) -> int:
    return len(text.split()) + 2


def vector_of(text: str, mode: str) -> list[float]:
    return [len(text.split()), len(text), MODES.index(mode), 1.0]


class StandInHandle:
    """Stands in for the app's Serve handle (see the module docstring)."""

    def __init__(self, failures=(), max_len: int = 16, max_total: int = 64,
                 max_chars: int = 10_000, policy: str = "reject") -> None:
        self.failures = list(failures)
        self.max_len, self.max_total, self.max_chars = max_len, max_total, max_chars
        self.policy = policy
        self.calls: list[Any] = []
        self.embed_batch = self

    def remote(self, call):
        self.calls.append(call)
        return _Answer(self, call)

    def answer(self, call) -> BatchResult:
        if self.failures:
            raise self.failures.pop(0)
        mode = call.long_input or self.policy
        if call.chunk_above and mode != "chunk":  # as the pipeline's request_policy refuses it
            raise InvalidParameterValue(f"chunk_above applies to chunked inputs; this request's "
                                        f"long-input mode is {mode!r}", param="chunk_above")
        if sum(len(t) for t in call.texts) > self.max_chars:
            raise RequestTooLarge(f"texts has {sum(len(t) for t in call.texts)} characters in "
                                  f"all, more than model 'm''s limits.max_chars of "
                                  f"{self.max_chars}; split it over several requests",
                                  param="texts")
        for k, text in enumerate(call.texts):
            n = tokens_of(text)
            if n > self.max_total:
                raise InputTooLong(f"input[{k}] has {n} tokens, more than the maximum total "
                                   f"input length of {self.max_total} tokens", param="input")
            if n > self.max_len and mode == "reject":
                raise InputTooLong(f"input[{k}] has {n} tokens, more than the model's maximum "
                                   f"context length of {self.max_len} tokens; ask for "
                                   "truncation or chunking to embed it", param="input")
        vectors = np.asarray([vector_of(t, mode) for t in call.texts], np.float32)
        return BatchResult(vectors, tuple(tokens_of(t) for t in call.texts), dict(PRINT))


class _Answer:
    def __init__(self, handle: StandInHandle, call) -> None:
        self.handle, self.call = handle, call

    def result(self):
        return self.handle.answer(self.call)


def embedder(handle: StandInHandle, settings: ec.JobSettings,
             skip: frozenset = frozenset()) -> ec.BatchEmbedder:
    """A worker on the stand-in handle (what its constructor would build inside Ray)."""
    e = ec.BatchEmbedder.__new__(ec.BatchEmbedder)
    e.settings, e.skip, e.router = settings, skip, handle
    e.pool = cf.ThreadPoolExecutor(1)  # one at a time: the stand-in's answers follow call order
    return e


def arrow_block(columns: dict[str, list]) -> Any:
    """A batch the way Ray Data hands one to a worker (``batch_format="pyarrow"``)."""
    import pyarrow as pa

    return pa.table(columns)


class Killed(Exception):
    """The driver stopped between two blocks (a SIGKILL, as far as the folder can tell)."""


def in_process_rest(handle: StandInHandle, kill_after: int | None = None):
    """A stand-in for ``embed_corpus._embed_rest`` (see the module docstring)."""

    def rest(files, out: Path, settings, workers, address, skip, fingerprint, log, done,
             progress):
        import pyarrow.parquet as pq

        per = settings.batch_size * settings.inflight
        if settings.kind == "json":
            import pyarrow as pa

            files_batch = pa.table({"bytes": [Path(f).read_bytes() for f in files]})
            cols = ec.jsonl_block(files_batch).to_pydict()  # the job's own split
        else:
            import pyarrow as pa

            cols = pa.concat_tables([pq.read_table(f) for f in files]).to_pydict()
        n_rows = len(next(iter(cols.values())))
        blocks_in = [{k: v[i:i + per] for k, v in cols.items()} for i in range(0, n_rows, per)]
        worker = embedder(handle, settings, skip)
        for n, block in enumerate(blocks_in):
            if kill_after is not None and n == kill_after:
                raise Killed(f"killed after {n} blocks")
            batch = worker(arrow_block(block))
            if batch.num_rows:
                e, r, t, fingerprint = take_block(out, batch, fingerprint, log, done)
                progress.add(e, r, t)
        return fingerprint

    return rest
