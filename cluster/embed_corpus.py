"""``embedfleet embed-corpus INPUT --model M --out DIR``: a whole corpus through the serving fleet.

A Ray Data job. On a card the job cannot start engines of its own (the serving replicas already
hold the cards' memory), so its workers send batches to the app's Serve handle
(``Router.embed_batch``) on the **bulk** lane: the online pipeline (the same prompts, chunking and
long-input policy, so the same vectors) at low priority, with interactive queries served first.

* Input: JSONL or Parquet files (a file or a folder of them) with ``id``, ``text`` and an
  optional ``prompt_name``.
* Output: Parquet parts in ``--out`` (``id``, ``embedding``, ``tokens``, ``fingerprint``), one
  per input block a worker handles, and ``errors.jsonl``: one line per refused row (``id``,
  ``code``, ``message``, ``row``). Every input row ends in exactly one of the two, also across a
  kill and a resume (``corpus_out`` says how).
* A row is refused, and the job goes on, when it is invalid (not JSON, no id, an id on several
  rows, an empty or non-string text: ``corpus_input``) or when the fleet refuses it (e.g. a text
  over the model's context under ``--long-input reject``). ``--long-input`` and
  ``--chunk-above`` are passed with every call, as ``long_input`` and ``chunk_above`` are on
  ``/v1/embeddings``; without them, the model's configured policy. The fleet refusing
  ``--chunk-above`` (the mode is not chunk) stops the job: it is about every row, not one.
* A call answered 4xx for one of its rows loses none of the others: a refusal that names its
  input (``input[k]``) refuses that row and sends the rest again; one that names none is
  bisected down to the row. Calls = 1 + refused rows (named), or ~2 log2(batch) per refused row.
* 429/503 (the bulk lane's bound, a replica being replaced) are retried after their
  ``Retry-After``, for up to ``--max-retry-s`` per call.
* Resumable: a rerun sends only the rows in neither a part nor errors.jsonl (so a row refused
  once stays refused: to embed refused rows under another ``--long-input``, use a new --out). A
  rerun against a fleet whose model fingerprint differs from the parts written stops, naming both.

Exit status: 0 every row is embedded; 2 the job finished and some rows are refused (the summary
counts them by code; errors.jsonl says which and why); 1 the job could not finish (another job
writes to --out, the fleet refused the job itself, e.g. an unknown model, a call kept failing
past --max-retry-s, a fingerprint changed, or a bad command line).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np

from .corpus_input import (CorpusError, Refusal, corpus_error, id_problem, input_files,
                           jsonl_block, missing, parse_line, scan, text_problem)
from .corpus_out import (ERRORS, MIXED, ErrorLog, OutLock, Progress,
                         finished_parts, take_block)
from ..deployments.common.long_input import ChunkAbove, LongInputMode

RETRYABLE_STATUS = (429, 503)
# Statuses a single row can cause (a text too long, a call's text too large in all); any other
# refusal (401/403 a key, 404 the model, 422 the call's shape, 5xx) is about the job: it stops.
ROW_STATUS = (400, 413)
LONG_INPUT_MODES: tuple[LongInputMode, ...] = get_args(LongInputMode)
CHUNK_ABOVE: tuple[ChunkAbove, ...] = get_args(ChunkAbove)
EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


@dataclass(frozen=True)
class JobSettings:
    app: str
    model: str
    batch_size: int  # texts per call to the Router
    inflight: int  # calls each worker keeps in flight
    max_retry_s: float  # how long one call may keep getting 429/503 before the job stops
    long_input: LongInputMode | None = None  # None: the model's configured policy
    kind: str = "json"  # the input's files: "json" (lines, parsed here) or "parquet"
    id_kind: str | None = None  # the corpus's ids: "str" or "int" (corpus_input.scan)
    chunk_above: ChunkAbove | None = None  # None: the model's configured policy


def fingerprint_of(headers: dict[str, str]) -> str:
    """One string a vector store can compare: digest / dtype / engine / platform."""
    return "/".join(headers.get(f"x-embedfleet-{k}", MIXED)
                    for k in ("model-digest", "dtype", "engine", "platform"))


def named_input(message: str, n: int) -> int | None:
    """The input a refusal names (the pipeline says ``input[k]``; a call is one slice, <= 128
    texts, so k is the call's own position), or None."""
    m = re.match(r"(?:input|texts)\[(\d+)\]", message)
    return int(m.group(1)) if m and int(m.group(1)) < n else None


def output_schema(id_kind: str | None) -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.int64() if id_kind == "int" else pa.string()),
                      ("embedding", pa.list_(pa.float32())), ("tokens", pa.int64()),
                      ("fingerprint", pa.string()), ("code", pa.string()),
                      ("message", pa.string())])


class BatchEmbedder:
    """A Ray Data worker: one input block in; its rows' vectors, and its refused rows, out."""

    def __init__(self, settings: JobSettings, skip_ref: Any) -> None:
        import ray
        from ray import serve

        self.settings = settings
        self.skip = ray.get(skip_ref) if skip_ref is not None else frozenset()
        # the app's ingress: the Router, or a one-model app's engine replicas (router.ingress)
        self.router = serve.get_app_handle(settings.app)
        self.pool = cf.ThreadPoolExecutor(settings.inflight)

    def _call(self, texts: list[str], prompt: str | None, first_id: Any) -> Any:
        """One call, retried while the fleet answers 429/503; other refusals are raised."""
        from ray.serve.exceptions import BackPressureError

        from ..deployments.common.contracts import BatchCall
        from ..deployments.common.errors import EmbedfleetError
        from ..deployments.ingress.remote import REPLICA_GONE

        call = BatchCall(self.settings.model, texts, prompt, "bulk", self.settings.long_input,
                         self.settings.chunk_above)
        deadline = time.monotonic() + self.settings.max_retry_s
        while True:
            try:
                return self.router.embed_batch.remote(call).result()
            except EmbedfleetError as err:
                if err.status not in RETRYABLE_STATUS:
                    raise
                wait, why = err.retry_after_s or 1.0, f"{err.status}: {err.message}"
            except (BackPressureError, *REPLICA_GONE) as err:
                wait, why = 1.0, type(err).__name__
            if time.monotonic() + wait > deadline:
                raise CorpusError(f"the call starting at id {first_id!r} could not be served "
                                  f"for {self.settings.max_retry_s:g}s; last: {why}")
            time.sleep(wait)

    def _embed_run(self, run: list[int], texts: list[str], prompt: str | None,
                   ids: list[Any]) -> tuple[dict[int, tuple[np.ndarray, int]], list[str],
                                            list[Refusal]]:
        """The rows ``run`` (one prompt): their vectors, the calls' fingerprints, the refused."""
        from ..deployments.common.errors import EmbedfleetError

        got: dict[int, tuple[np.ndarray, int]] = {}
        prints: list[str] = []
        refused: list[Refusal] = []
        pending = [run]
        while pending:
            rows = pending.pop()
            try:
                res = self._call([texts[i] for i in rows], prompt, ids[rows[0]])
            except EmbedfleetError as err:
                if err.status not in ROW_STATUS or err.param == "chunk_above":
                    raise CorpusError(f"the fleet refused the call starting at id "
                                      f"{ids[rows[0]]!r} ({err.status} {err.code}): "
                                      f"{err.message}") from None
                k = named_input(err.message, len(rows))
                why = re.sub(r"^(?:input|texts)\[\d+\]", "the text", err.message)
                if k is not None:  # that row; the others again, without it
                    refused.append(Refusal(ids[rows[k]], err.code, why))
                    pending.extend([rows[:k] + rows[k + 1:]] if len(rows) > 1 else [])
                elif len(rows) == 1 or err.param == "prompt_name":  # the row, or all of one prompt
                    refused.extend(Refusal(ids[i], err.code, why) for i in rows)
                else:  # a refusal of the call as a whole (e.g. 413, its texts in all): halves
                    half = len(rows) // 2
                    pending.extend([rows[half:], rows[:half]])
                continue
            for j, i in enumerate(rows):
                got[i] = (res.vectors[j], res.tokens[j])
            prints.append(fingerprint_of(res.fingerprint))
        return got, prints, refused

    def _rows(self, rows: Any) -> list[tuple[Any, Any, Any]]:
        """(id, text, prompt_name) of the block's rows (an Arrow table: ids and nulls as they
        are; numpy would hand an int column with a null as floats). A JSONL block holds lines."""
        if self.settings.kind == "json":
            out = []
            for line in rows.column("text").to_pylist():
                row = parse_line(line)
                if row is not None:  # a line that is not JSON: refused by the scan
                    out.append((row.get("id"), row.get("text"), row.get("prompt_name")))
            return out
        ids, texts = rows.column("id").to_pylist(), rows.column("text").to_pylist()
        prompts = (rows.column("prompt_name").to_pylist() if "prompt_name" in rows.column_names
                   else [None] * len(ids))
        return list(zip(ids, texts, prompts))

    def __call__(self, rows: Any) -> Any:
        import pyarrow as pa

        ids: list[Any] = []
        texts: list[str] = []
        prompts: list[str | None] = []
        refused: list[Refusal] = []
        for x, text, prompt in self._rows(rows):
            if id_problem(x, self.settings.id_kind) is not None or x in self.skip:
                continue  # refused by the scan (ids), or already in a part or errors.jsonl
            bad = text_problem(text, prompt)
            if bad is not None:
                refused.append(Refusal(x, *bad))
                continue
            ids.append(x)
            texts.append(text)
            prompts.append(None if missing(prompt) or not prompt else prompt)
        # One call per run of the same prompt_name, at most batch_size texts each.
        runs: list[list[int]] = []
        for i in range(len(ids)):
            if (not runs or prompts[i] != prompts[runs[-1][0]]
                    or len(runs[-1]) == self.settings.batch_size):
                runs.append([])
            runs[-1].append(i)
        futures = [self.pool.submit(self._embed_run, r, texts, prompts[r[0]], ids) for r in runs]
        got: dict[int, tuple[np.ndarray, int]] = {}
        prints: set[str] = set()
        for f in futures:
            g, p, r = f.result()
            got.update(g)
            prints.update(p)
            refused.extend(r)
        fingerprint = prints.pop() if len(prints) == 1 else MIXED
        done = sorted(got)
        n, m = len(done), len(refused)
        # One list array over the block's vectors (refused rows: null, empty), not a row each.
        flat = (np.concatenate([got[i][0] for i in done]).astype(np.float32, copy=False)
                if n else np.zeros(0, np.float32))
        ends = np.arange(n + 1, dtype=np.int32) * (len(flat) // max(n, 1))
        embedding = pa.ListArray.from_arrays(
            pa.array(np.concatenate([ends, np.full(m, ends[-1], np.int32)])), pa.array(flat),
            mask=pa.array([False] * n + [True] * m, pa.bool_()))
        return pa.table({
            "id": [ids[i] for i in done] + [r.id for r in refused],
            "embedding": embedding,
            "tokens": [int(got[i][1]) for i in done] + [None] * m,
            "fingerprint": [fingerprint] * n + [None] * m,
            "code": [None] * n + [r.code for r in refused],
            "message": [None] * n + [r.message for r in refused],
        }, schema=output_schema(self.settings.id_kind))


def run(input_path: Path, out: Path, settings: JobSettings, workers: int,
        address: str | None = None) -> dict[str, Any]:
    """The job; returns its summary. One writer per ``out`` (``OutLock``)."""
    kind, files = input_files(input_path)
    out.mkdir(parents=True, exist_ok=True)
    with OutLock(out):
        for stale in out.glob(".part-*.tmp"):  # a killed run's unfinished part
            stale.unlink()
        done, fingerprint = finished_parts(out)
        log = ErrorLog(out)
        found = scan(kind, files)  # ids checked while reading, before any call
        new = [r for r in found.refusals if r.row not in log.rows]
        log.append(new)
        if new:
            print(f"embed-corpus: {len(new):,} rows refused while reading the input; see "
                  f"{out / ERRORS}", file=sys.stderr)
        settings = dataclasses.replace(settings, kind=kind, id_kind=found.kind)
        progress = Progress(found.total, len(done) + log.lines, log.lines)
        if len(done) + log.lines < found.total:
            skip = frozenset(done | log.ids | found.duplicated)
            fingerprint = _embed_rest(files, out, settings, workers, address, skip, fingerprint,
                                      log, done, progress)
        progress.add(0, 0, 0, final=True)
        both = sorted(done & log.ids, key=str)
        if both or len(done) + log.lines != found.total:
            raise CorpusError(f"{out} holds {len(done):,} embedded and {log.lines:,} refused rows "
                              f"for {found.total:,} input rows (ids in both: {both[:3]}): it "
                              "holds another corpus's results, or the input changed; use a new "
                              "--out")
        return {"embedded": progress.embedded, "held": len(done), "refused": log.lines,
                "codes": log.summary(), "total": found.total,
                "texts_per_s": progress.texts_per_s}


def _embed_rest(files: list[str], out: Path, settings: JobSettings, workers: int,
                address: str | None, skip: frozenset, fingerprint: str | None, log: ErrorLog,
                done: set[Any], progress: Progress) -> str | None:
    import ray

    ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # (it warns of what we set next)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the job prints its own (rows, texts/s, ETA)
        # Read tasks are light; the engines may hold every whole CPU of a node.
        if settings.kind == "json":  # whole files, split at "\n" only (corpus_input)
            ds = ray.data.read_binary_files(files, num_cpus=0.1).map_batches(
                jsonl_block, batch_size=1, batch_format="pyarrow", num_cpus=0.1)
        else:
            import pyarrow.parquet as pq

            prompt = all("prompt_name" in pq.read_schema(f).names for f in files)
            ds = ray.data.read_parquet(files, num_cpus=0.1, columns=[
                "id", "text", *(["prompt_name"] if prompt else [])])
        # Blocks of at most one part's rows: a part is what a worker returns for one block,
        # and what a kill can lose.
        rows = settings.batch_size * settings.inflight
        ds = ds.repartition(target_num_rows_per_block=rows)
        embedded = ds.map_batches(
            BatchEmbedder, fn_constructor_args=(settings, ray.put(skip) if skip else None),
            batch_size=rows, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=0.1,
            # A worker that dies fails the job instead of restarting: a rerun resumes, and Ray
            # warns on every run about restarting actors whose arguments live in the store.
            max_restarts=0)
        for batch in embedded.iter_batches(batch_size=None, batch_format="pyarrow"):
            if batch.num_rows:
                n_ok, n_bad, tokens, fingerprint = take_block(out, batch, fingerprint, log, done)
                progress.add(n_ok, n_bad, tokens)
        return fingerprint
    finally:
        ray.shutdown()


def cmd_embed_corpus(args: argparse.Namespace) -> int:
    from ..deployments.ingress.pipeline import SLICE_INPUTS

    # One call is one slice of the pipeline, so a refusal's input[k] names the row.
    if not 1 <= args.batch_size <= SLICE_INPUTS or args.inflight < 1 or args.workers < 1:
        print(f"error: --batch-size must be 1..{SLICE_INPUTS} (got {args.batch_size}), "
              f"--inflight and --workers >= 1 (got {args.inflight}, {args.workers})",
              file=sys.stderr)
        return EXIT_FAILED
    if args.chunk_above and args.long_input not in (None, "chunk"):
        print(f"error: --chunk-above applies to chunked texts; --long-input is "
              f"{args.long_input} (use --long-input chunk, or drop --chunk-above)",
              file=sys.stderr)
        return EXIT_FAILED
    settings = JobSettings(args.app, args.model, args.batch_size, args.inflight,
                           args.max_retry_s, args.long_input, chunk_above=args.chunk_above)
    try:
        s = run(Path(args.input), Path(args.out), settings, args.workers, args.address)
    except Exception as exc:
        why = corpus_error(exc)
        if why is None:
            raise
        print(f"\nerror: {why}", file=sys.stderr)
        return EXIT_FAILED
    where = f" ({s['codes']}; see {Path(args.out) / ERRORS})" if s["refused"] else ""
    print(f"embedded {s['embedded']:,} rows in this run; {args.out} holds {s['held']:,} of "
          f"{s['total']:,} rows embedded and {s['refused']:,} refused{where} "
          f"({s['texts_per_s']:,.0f} texts/s)")
    return EXIT_REFUSED if s["refused"] else EXIT_OK


EPILOG = """\
exit status:
  0  every row is embedded (OUT/part-*.parquet)
  2  the job finished, and some rows are refused: OUT/errors.jsonl has one line per refused row
     (id, code, message, row); the summary counts them by code
  1  the job could not finish (run it again to resume: rows already in OUT are not sent again)
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("embed-corpus", help="embed a JSONL/Parquet corpus through the serving "
                       "fleet on the bulk lane (a Ray Data job; resumable)", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Embed every row of a corpus through the serving fleet. Rows "
                       "that are invalid (not JSON, no id, an id on several rows, an empty or "
                       "non-string text) or that the model refuses go to OUT/errors.jsonl; the "
                       "job goes on.")
    # Usage errors exit 1 too (argparse's own is 2, this command's "finished with refused rows"),
    # unknown options included (argparse leaves those to the top-level parser).
    p.error = lambda message: p.exit(EXIT_FAILED, f"{p.prog}: error: {message}\n")
    known = p.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, extra = known(args, namespace)
        if extra:
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]
    p.add_argument("input", help="a .jsonl or .parquet file, or a folder of them (id, text, "
                   "optional prompt_name)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="output folder: Parquet parts and errors.jsonl "
                   "(one job at a time)")
    p.add_argument("--long-input", choices=LONG_INPUT_MODES, default=None,
                   help="a text longer than the model's context: truncate it, chunk it, or "
                   "reject it (to errors.jsonl); default: the model's configured policy")
    p.add_argument("--chunk-above", choices=CHUNK_ABOVE, default=None,
                   help="in chunk mode, which texts are split into windows: those over the "
                   "model's context (max_model_len) or every text (always); default: the "
                   "model's configured policy")
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
                   help="stop when one call is refused (429/503) for this long (default: 600)")
    p.set_defaults(func=cmd_embed_corpus)
