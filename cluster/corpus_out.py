"""The corpus job's output folder: its lock, its Parquet parts and its ``errors.jsonl``.

Every input row ends in exactly one place: a part (embedded) or ``errors.jsonl`` (refused), also
across a kill and a resume. What makes that hold:

* **One writer.** ``OutLock`` is a file created exclusively, holding the owner's pid, host and
  start time. A second job on the folder is refused, naming the owner; a lock whose pid is dead
  on this host (a killed job) is taken over, and the job says so. A lock of another host is never
  taken over: its pid means nothing here.
* **Parts are whole or absent.** Written under a temporary name, fsync'd, renamed, and the folder
  fsync'd, so a crash leaves the old name or the whole new file. A part that is nonetheless
  truncated or corrupt (a disk, a copy) is reported by name on resume and moved to
  ``.corrupt/``; its rows are embedded again.
* **errors.jsonl is appended after the rows are decided, and fsync'd.** A kill can cut its last
  line; a resume drops that partial line, and the row it named is checked again. A refused row is
  never in a part (the worker returns it as refused, not embedded), and a resume skips the ids of
  both, so nothing is written twice.

The job's own files have hidden names (``.lock``, ``.part-*.tmp``, ``.corrupt/``), which Arrow's
dataset discovery skips; ``errors.jsonl`` is for people and keeps its plain name, so readers take
the parts as ``OUT/part-*.parquet`` (``pyarrow.parquet.read_table(OUT)`` would try it as Parquet).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .corpus_input import CorpusError, Refusal

PART_GLOB = "part-*.parquet"
MIXED = "mixed"  # the calls of one block were answered by replicas of different fingerprints
LOCK = ".lock"
ERRORS = "errors.jsonl"
CORRUPT = ".corrupt"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class OutLock:
    """One writer per output folder (see the module docstring). A context manager."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": self.host, "token": self.token,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def acquire(self) -> None:
        for _ in range(40):  # another job may take or release the lock at the same moment
            if self._create():
                return
            try:
                owner = json.loads(self.path.read_text())
                pid, host = int(owner["pid"]), str(owner["host"])
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError):
                if time.time() - self.path.stat().st_mtime < 2:  # being written: read it again
                    time.sleep(0.1)
                    continue
                raise CorpusError(f"{self.path} is not a lock this job can read; if no job is "
                                  "writing to the folder, delete it") from None
            since = owner.get("started", "?")
            if host != self.host or _pid_alive(pid):
                raise CorpusError(f"another embed-corpus job writes to {self.path.parent} (pid "
                                  f"{pid} on {host}, since {since}); one job per --out. If it "
                                  f"is gone, delete {self.path}")
            try:  # dead on this host: move it aside (one taker wins the rename), then create
                os.rename(self.path, self.path.with_name(f"{LOCK}.stale-{self.token}"))
            except FileNotFoundError:
                continue
            self.path.with_name(f"{LOCK}.stale-{self.token}").unlink()
            print(f"embed-corpus: took over the lock of pid {pid} on {host} (since {since}), "
                  "which is no longer running", file=sys.stderr)
        raise CorpusError(f"could not take {self.path}: other jobs are taking it at the same time")

    def release(self) -> None:
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (FileNotFoundError, ValueError):
            pass

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(out: Path, ids: list[Any], vectors: np.ndarray, tokens: np.ndarray,
               fingerprint: str) -> int:
    """One finished part, whole or absent. Returns its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(ids)
    if n == 0:
        return 0
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    table = pa.table({
        "id": pa.array(ids),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)),
                                                       vectors.shape[1]),
        "tokens": pa.array(tokens, pa.int64()),
        "fingerprint": pa.array([fingerprint] * n, pa.string()),
    })
    name = f"part-{uuid.uuid4().hex[:16]}.parquet"
    tmp = out / f".{name}.tmp"
    with open(tmp, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(out / name)
    _fsync_dir(out)
    return n


def finished_parts(out: Path) -> tuple[set[Any], str | None]:
    """The ids in the finished parts and the fingerprint they were embedded with. A part that
    cannot be read whole is moved to ``.corrupt/`` and named; its rows are done again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done: set[Any] = set()
    prints: set[str] = set()
    for part in sorted(out.glob(PART_GLOB)):
        try:
            meta = pq.read_metadata(part)
            table = pq.read_table(part, columns=["id", "fingerprint"])
            if "embedding" not in meta.schema.to_arrow_schema().names:
                raise ValueError("no embedding column")
            if table.num_rows != meta.num_rows:
                raise ValueError(f"{table.num_rows} of {meta.num_rows} rows readable")
        except (pa.ArrowException, OSError, ValueError, KeyError) as err:
            aside = out / CORRUPT
            aside.mkdir(exist_ok=True)
            part.rename(aside / part.name)
            why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(f"embed-corpus: {part.name} is truncated or corrupt ({why}); moved to "
                  f"{CORRUPT}/{part.name}, its rows are embedded again", file=sys.stderr)
            continue
        done.update(table.column("id").to_pylist())
        prints.update(table.column("fingerprint").unique().to_pylist())
    if len(prints) > 1:
        raise CorpusError(f"{out} holds parts of several fingerprints {sorted(prints)}; "
                          "use one --out per model version")
    return done, next(iter(prints), None)


class ErrorLog:
    """``OUT/errors.jsonl``: one line per refused row (id, code, message, row)."""

    def __init__(self, out: Path) -> None:
        self.path = out / ERRORS
        self.ids: set[Any] = set()  # ids refused by the workers (valid, unique ids)
        self.rows: set[str] = set()  # where the scan's refusals are ("file:line")
        self.codes: Counter[str] = Counter()
        self.lines = 0
        self._read()

    def _read(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a killed run's last, partial line
            keep = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
            print(f"embed-corpus: {ERRORS} ended in a partial line (a killed run); dropped it, "
                  "its row is checked again", file=sys.stderr)
            data = data[:keep]
        for n, line in enumerate(data.split(b"\n")[:-1], 1):  # JSON Lines: "\n" ends a row
            try:
                rec = json.loads(line)
                code, row = str(rec["code"]), rec.get("row")
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"{self.path}:{n} is not one of this job's lines; the folder "
                                  "holds another file by that name") from None
            self._count(rec.get("id"), code, row)

    def _count(self, id_: Any, code: str, row: str | None) -> None:
        if row is None:
            self.ids.add(id_)
        else:
            self.rows.add(row)
        self.codes[code] += 1
        self.lines += 1

    def append(self, refusals: list[Refusal]) -> None:
        """Append and fsync (a kill can cut at most the last line, which ``_read`` drops)."""
        if not refusals:
            return
        body = "".join(json.dumps(r.record(), ensure_ascii=False, default=str) + "\n"
                       for r in refusals)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        for r in refusals:
            self._count(r.id, r.code, r.row)

    def summary(self) -> str:
        return ", ".join(f"{code} {n:,}" for code, n in sorted(self.codes.items()))


class Progress:
    """Rows done (embedded or refused) of the total, rows refused, tokens/s, texts/s and ETA, at
    most once a second (stderr)."""

    def __init__(self, total: int, done: int, refused: int) -> None:
        self.total, self.done, self.start_done = total, done, done
        self.refused, self.embedded, self.tokens = refused, 0, 0
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, embedded: int, refused: int, tokens: int, final: bool = False) -> None:
        self.done += embedded + refused
        self.embedded += embedded
        self.refused += refused
        self.tokens += tokens
        now = time.monotonic()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        dt = max(now - self.t0, 1e-6)
        rate = (self.done - self.start_done) / dt
        eta = f"{(self.total - self.done) / rate:,.0f} s" if rate > 0 else "-"
        line = (f"embed-corpus: {self.done:,}/{self.total:,} rows "
                f"({100 * self.done / max(self.total, 1):.1f}%) · {self.refused:,} refused · "
                f"{self.tokens / dt:,.0f} tokens/s · {self.embedded / dt:,.0f} texts/s · "
                f"ETA {eta}")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)

    @property
    def texts_per_s(self) -> float:
        return self.embedded / max(time.monotonic() - self.t0, 1e-6)


def take_block(out: Path, batch: Any, fingerprint: str | None, log: ErrorLog,
               done: set[Any]) -> tuple[int, int, int, str | None]:
    """One worker's block: its part written, then its refusals appended (either may be empty).
    Returns (embedded, refused, tokens, the folder's fingerprint)."""
    import pyarrow.compute as pc

    ok = pc.is_null(batch.column("code"))
    emb, bad = batch.filter(ok), batch.filter(pc.invert(ok))
    if emb.num_rows:
        got = emb.column("fingerprint")[0].as_py()
        if MIXED in got.split("/") or got == MIXED:
            raise CorpusError(f"replicas of different model fingerprints served one block "
                              f"(a rolling update?): {got}; run the job again when it is done")
        if fingerprint is None:
            fingerprint = got
        elif got != fingerprint:
            raise CorpusError(f"the model now serves fingerprint {got}, but {out} holds "
                              f"vectors of {fingerprint}; use a new --out")
        ids = emb.column("id").to_pylist()
        flat = np.asarray(emb.column("embedding").combine_chunks().flatten(), np.float32)
        tokens = np.asarray(emb.column("tokens"), np.int64)
        write_part(out, ids, flat.reshape(len(ids), -1), tokens, fingerprint)
        done.update(ids)
    log.append([Refusal(*r) for r in zip(*(bad.column(c).to_pylist()
                                          for c in ("id", "code", "message")))])
    return emb.num_rows, bad.num_rows, int(pc.sum(emb.column("tokens")).as_py() or 0), fingerprint
