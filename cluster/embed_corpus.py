"""``embedfleet embed-corpus INPUT --model M --out DIR``: a whole corpus through the serving fleet.

A Ray Data job. On a card the job cannot start engines of its own (the serving replicas already
hold the cards' memory), so its workers send batches to the Router's Serve handle
(``Router.embed_batch``) on the **bulk** lane: the online pipeline (the same prompts, chunking and
long-input policy, so the same vectors) at low priority, with interactive queries served first.

* Input: JSONL or Parquet files (a file or a folder of them) with ``id``, ``text`` and an
  optional ``prompt_name``. Ids must be unique.
* Output: Parquet parts in ``--out`` (``id``, ``embedding``, ``tokens``, ``fingerprint``), one
  per input block Ray Data hands a worker. The driver writes each part to a temporary name and
  renames it, so a part is whole or absent.
* Resumable: a rerun reads the ids of the finished parts and sends only the rest, so a job
  killed at any point and run again loses and duplicates no id. A rerun against a fleet whose
  model fingerprint differs from the parts already written stops, naming both.
* 429/503 (the bulk lane's bound, a replica being replaced) are retried after their
  ``Retry-After``; a 4xx (a text the model's long-input policy rejects) stops the job naming the
  id.
"""

from __future__ import annotations

import argparse
import logging
import re
import concurrent.futures as cf
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


PART_GLOB = "part-*.parquet"
MIXED = "mixed"  # the calls of one block were answered by replicas of different fingerprints
RETRYABLE_STATUS = (429, 503)


class CorpusError(Exception):
    """The job cannot go on (bad input, a rejected text, a fingerprint that changed)."""


def input_files(path: Path) -> tuple[str, list[str]]:
    """("json" | "parquet", the files) of INPUT: a file, or a folder of one kind of file."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    found = {kinds.get(p.suffix) for p in files}
    if not files or None in found or len(found) != 1:
        raise CorpusError(f"{path}: expected .jsonl or .parquet files (one kind), found "
                          f"{sorted(p.name for p in files)[:5] or 'nothing'}")
    return found.pop(), [str(p.resolve()) for p in files]


def finished_ids(out: Path) -> tuple[set[Any], str | None]:
    """The ids already in finished parts, and the fingerprint they were embedded with."""
    import pyarrow.parquet as pq

    done: set[Any] = set()
    prints: set[str] = set()
    for part in sorted(out.glob(PART_GLOB)):
        table = pq.read_table(part, columns=["id", "fingerprint"])
        done.update(table.column("id").to_pylist())
        prints.update(table.column("fingerprint").unique().to_pylist())
    if len(prints) > 1:
        raise CorpusError(f"{out} holds parts of several fingerprints {sorted(prints)}; "
                          "use one --out per model version")
    return done, next(iter(prints), None)


def count_rows(kind: str, files: list[str]) -> int:
    """Rows of the input, checking that each file has ``id`` and ``text`` (the first row of a
    JSONL file, the schema of a Parquet one)."""
    import json

    import pyarrow.parquet as pq

    total = 0
    for f in files:
        if kind == "parquet":
            meta = pq.read_metadata(f)
            names, rows = set(meta.schema.names), meta.num_rows
        else:
            names, rows = set(), 0
            with open(f, "rb") as fh:
                for line in fh:
                    if line.strip():
                        if not rows:
                            try:
                                names = set(json.loads(line))
                            except ValueError as err:
                                raise CorpusError(f"{f}: line 1 is not JSON ({err})") from None
                        rows += 1
        missing = {"id", "text"} - names
        if rows and missing:
            raise CorpusError(f"{f}: no {sorted(missing)} field (each row needs id and text, "
                              "and may have prompt_name)")
        total += rows
    return total


@dataclass(frozen=True)
class JobSettings:
    app: str
    model: str
    batch_size: int  # texts per call to the Router
    inflight: int  # calls each worker keeps in flight
    max_retry_s: float  # how long one batch may keep getting 429/503 before the job stops


def fingerprint_of(headers: dict[str, str]) -> str:
    """One string a vector store can compare: digest / dtype / engine / platform."""
    return "/".join(headers.get(f"x-embedfleet-{k}", MIXED)
                    for k in ("model-digest", "dtype", "engine", "platform"))


class BatchEmbedder:
    """A Ray Data worker: one input block in, its rows' vectors out, through the Router."""

    def __init__(self, settings: JobSettings, done_ref: Any) -> None:
        import ray
        from ray import serve

        self.settings = settings
        self.done = ray.get(done_ref) if done_ref is not None else frozenset()
        # the app's ingress: the Router, or a one-model app's engine replicas (router.ingress)
        self.router = serve.get_app_handle(settings.app)
        self.pool = cf.ThreadPoolExecutor(settings.inflight)

    def _call(self, texts: list[str], prompt: str | None, ids: list[Any]) -> Any:
        from ray.serve.exceptions import BackPressureError

        from embedfleet.deployments.contracts import BatchCall
        from embedfleet.deployments.errors import EmbedfleetError
        from embedfleet.deployments.request_path.remote import REPLICA_GONE

        call = BatchCall(self.settings.model, texts, prompt, "bulk")
        deadline = time.monotonic() + self.settings.max_retry_s
        while True:
            try:
                return self.router.embed_batch.remote(call).result()
            except EmbedfleetError as err:
                if err.status not in RETRYABLE_STATUS:
                    raise CorpusError(f"{refused_row(ids, err.message)} was refused "
                                      f"({err.status} {err.code}): {err.message}") from None
                wait, why = err.retry_after_s or 1.0, f"{err.status}: {err.message}"
            except (BackPressureError, *REPLICA_GONE) as err:
                wait, why = 1.0, type(err).__name__
            if time.monotonic() + wait > deadline:
                raise CorpusError(f"the batch starting at id {ids[0]!r} could not be served "
                                  f"for {self.settings.max_retry_s:g}s; last: {why}")
            time.sleep(wait)

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, Any]:
        ids = [_missing_to_none(x) for x in rows["id"].tolist()]
        texts_in = rows["text"].tolist()
        prompts_in = (rows["prompt_name"].tolist() if "prompt_name" in rows
                      else [None] * len(ids))
        keep: list[int] = []
        for i, x in enumerate(ids):
            if x is None:
                raise CorpusError(f"a row has no id (its text begins {str(texts_in[i])[:40]!r})")
            if x in self.done:
                continue
            if not isinstance(texts_in[i], str) or not texts_in[i]:
                raise CorpusError(f"row id {x!r} has no text ({texts_in[i]!r})")
            keep.append(i)
        texts = [texts_in[i] for i in keep]
        prompts = [_missing_to_none(prompts_in[i]) or None for i in keep]
        # One call per run of the same prompt_name, at most batch_size texts each.
        calls: list[tuple[int, int]] = []
        start = 0
        for k in range(1, len(keep) + 1):
            if (k == len(keep) or prompts[k] != prompts[start]
                    or k - start == self.settings.batch_size):
                calls.append((start, k))
                start = k
        futures = [self.pool.submit(self._call, texts[a:b], prompts[a],
                                    [ids[i] for i in keep[a:b]])
                   for a, b in calls if b > a]
        results = [f.result() for f in futures]
        if not results:
            return {"id": np.asarray([], dtype=object), "tokens": np.zeros(0, np.int64),
                    "fingerprint": np.asarray([], dtype=object)}
        prints = {fingerprint_of(r.fingerprint) for r in results}
        return {"id": np.asarray([ids[i] for i in keep], dtype=object),
                "embedding": np.concatenate([r.vectors for r in results]).astype(np.float32),
                "tokens": np.asarray([t for r in results for t in r.tokens], np.int64),
                "fingerprint": np.asarray([prints.pop() if len(prints) == 1 else MIXED]
                                          * len(keep), dtype=object)}


def refused_row(ids: list[Any], message: str) -> str:
    """The row a refusal names (the pipeline says ``input[k]``; calls are one slice, <= 128
    texts), or the batch's first row when it names none."""
    m = re.match(r"input\[(\d+)\]", message)
    if m and int(m.group(1)) < len(ids):
        return f"row id {ids[int(m.group(1))]!r}"
    return f"the batch starting at id {ids[0]!r}"


def _missing_to_none(x: Any) -> Any:
    """Ray Data hands a missing value as None, or as NaN in a column it typed as float."""
    return None if x is None or (isinstance(x, float) and x != x) else x


def write_part(out: Path, batch: dict[str, np.ndarray]) -> int:
    """One finished part, whole or absent (temporary name, then rename). Returns its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(batch["id"])
    if n == 0:
        return 0
    vectors = np.ascontiguousarray(batch["embedding"], dtype=np.float32)
    dim = vectors.shape[1]
    table = pa.table({
        "id": pa.array(np.asarray(batch["id"]).tolist()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
        "tokens": pa.array(batch["tokens"], pa.int64()),
        "fingerprint": pa.array([str(x) for x in batch["fingerprint"]], pa.string()),
    })
    name = f"part-{uuid.uuid4().hex[:16]}.parquet"
    tmp = out / f".{name}.tmp"
    pq.write_table(table, tmp)
    tmp.rename(out / name)
    return n


class Progress:
    """rows done / total, tokens/s, texts/s and ETA, at most once a second (stderr)."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.start_done = total, done, done
        self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, rows: int, tokens: int, final: bool = False) -> None:
        self.done += rows
        self.tokens += tokens
        now = time.monotonic()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        dt = max(now - self.t0, 1e-6)
        rate = (self.done - self.start_done) / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        line = (f"embed-corpus: {self.done:,}/{self.total:,} rows "
                f"({100 * self.done / max(self.total, 1):.1f}%) · {self.tokens / dt:,.0f} tokens/s"
                f" · {rate:,.0f} texts/s · ETA {eta:,.0f} s")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)

    @property
    def texts_per_s(self) -> float:
        return (self.done - self.start_done) / max(time.monotonic() - self.t0, 1e-6)


def run(input_path: Path, out: Path, settings: JobSettings, workers: int,
        address: str | None = None) -> dict[str, Any]:
    """The job; returns its summary (rows embedded now, total, texts/s)."""
    import ray

    kind, files = input_files(input_path)
    total = count_rows(kind, files)  # here, not by a Ray Data pass: that would read it twice
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".part-*.tmp"):  # a killed run's unfinished part
        stale.unlink()
    done, fingerprint = finished_ids(out)
    ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # (it warns of what we set next)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the job prints its own (rows, tokens/s, ETA)
        read = ray.data.read_json if kind == "json" else ray.data.read_parquet
        # Read tasks are light; the engines may hold every whole CPU of a node.
        # Blocks of at most one part's rows: a part is what a worker returns for one block,
        # and what a kill can lose.
        ds = read(files, num_cpus=0.1).repartition(
            target_num_rows_per_block=settings.batch_size * settings.inflight)
        progress = Progress(total, len(done))
        if len(done) >= total:
            progress.add(0, 0, final=True)
            return {"embedded": 0, "held": len(done), "total": total, "texts_per_s": 0.0}
        done_ref = ray.put(frozenset(done)) if done else None
        embedded = ds.map_batches(
            BatchEmbedder, fn_constructor_args=(settings, done_ref),
            batch_size=settings.batch_size * settings.inflight, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=0.1,
            # A worker that dies fails the job instead of restarting: a rerun resumes, and Ray
            # warns on every run about restarting actors whose arguments live in the store.
            max_restarts=0)
        written = 0
        for batch in embedded.iter_batches(batch_size=None, batch_format="numpy"):
            if len(batch["id"]) == 0:
                continue
            got = str(batch["fingerprint"][0])
            if MIXED in got.split("/") or got == MIXED:
                raise CorpusError(f"replicas of different model fingerprints served one block "
                                  f"(a rolling update?): {got}; run the job again when it is done")
            if fingerprint is None:
                fingerprint = got
            elif got != fingerprint:
                raise CorpusError(f"the model now serves fingerprint {got}, but {out} holds "
                                  f"vectors of {fingerprint}; use a new --out")
            n = write_part(out, batch)
            done.update(np.asarray(batch["id"]).tolist())
            written += n
            progress.add(n, int(np.sum(batch["tokens"])))
        progress.add(0, 0, final=True)
        held = len(done)  # distinct ids in the folder: the finished parts' plus this run's
        if held != total:
            raise CorpusError(f"{out} holds {held:,} distinct ids for {total:,} input rows: the "
                              "input repeats ids, or the folder holds another corpus's parts")
        return {"embedded": written, "held": held, "total": total,
                "texts_per_s": progress.texts_per_s}
    finally:
        ray.shutdown()


def corpus_error(exc: BaseException) -> str | None:
    """The job's own reason to stop, also when a worker raised it: Ray Data re-raises a worker's
    exception wrapped (``UserCodeException`` in a ``RayTaskError``), the message kept in text."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, CorpusError):
            return str(seen)
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    marker = f"{CorpusError.__name__}: "
    text = str(exc)
    if marker in text:
        return text[text.rindex(marker) + len(marker):].strip().splitlines()[0]
    return None


def cmd_embed_corpus(args: argparse.Namespace) -> int:
    from embedfleet.deployments.request_path.pipeline import SLICE_INPUTS

    # One call is one slice of the pipeline, so a refusal's input[k] names the row.
    if not 1 <= args.batch_size <= SLICE_INPUTS or args.inflight < 1 or args.workers < 1:
        print(f"error: --batch-size must be 1..{SLICE_INPUTS} (got {args.batch_size}), "
              f"--inflight and --workers >= 1 (got {args.inflight}, {args.workers})",
              file=sys.stderr)
        return 2
    settings = JobSettings(args.app, args.model, args.batch_size, args.inflight,
                           args.max_retry_s)
    try:
        summary = run(Path(args.input), Path(args.out), settings, args.workers, args.address)
    except Exception as exc:
        why = corpus_error(exc)
        if why is None:
            raise
        print(f"\nerror: {why}", file=sys.stderr)
        return 2
    print(f"embedded {summary['embedded']:,} rows in this run; {args.out} holds "
          f"{summary['held']:,} of {summary['total']:,} ({summary['texts_per_s']:,.0f} texts/s)")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("embed-corpus", help="embed a JSONL/Parquet corpus through the serving "
                       "fleet on the bulk lane (a Ray Data job; resumable)")
    p.add_argument("input", help="a .jsonl or .parquet file, or a folder of them (id, text, "
                   "optional prompt_name)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="output folder of Parquet parts")
    p.add_argument("--app", default="embedfleet", help="the Serve application (default: "
                   "embedfleet)")
    p.add_argument("--address", help="Ray address (default: the local cluster)")
    p.add_argument("--workers", type=int, default=2, help="Ray Data workers (default: 2)")
    # A call's tokens above the replica's admission budget (`admission.max_tokens`) run alone;
    # the defaults keep calls of short texts within the CPU profile's small test budgets.
    p.add_argument("--batch-size", type=int, default=64,
                   help="texts per call, at most 128 (default: 64)")
    p.add_argument("--inflight", type=int, default=2,
                   help="calls each worker keeps in flight (default: 2); a part holds "
                   "batch-size x inflight rows")
    p.add_argument("--max-retry-s", type=float, default=600.0,
                   help="stop when one batch is refused (429/503) for this long (default: 600)")
    p.set_defaults(func=cmd_embed_corpus)
