"""The corpus job's input: which files, what a row is, which rows are refused before any call.

Real corpora have broken rows: a line that is not JSON, a row without an id, an id used twice, an
empty text, a number where the text should be. None of them may stop a job of millions of rows,
and each must end somewhere the user can see: ``OUT/errors.jsonl``.

Two places check rows, each what only it can:

* ``scan`` (the driver, once, before any call): what needs the whole input — the row count (for
  progress and the final check) and the ids: missing, of the wrong kind, or on more than one row.
  An id on several rows refuses **every** one of them (``duplicate_id``): which of the texts the
  id stands for cannot be told, and embedding one would store a vector under an id chosen by the
  order Ray Data happened to read the rows in. Found while reading, before the first call.
* ``text_problem`` (the worker, per row): the text and prompt name, which the worker reads anyway.

JSONL is read by Ray Data as whole files (``read_binary_files``), split into lines and parsed
here, not by Arrow's JSON reader (it fails the whole file on one row whose text is a number: its
column "changed type") nor as ``read_text`` lines: that splits with ``str.splitlines``, which
also breaks at U+2028, U+2029, U+0085 and other characters a JSON string may hold raw, cutting
such a row in two. JSON Lines ends a row at ``\n`` only, and the scan (``jsonl_rows``) and the
workers (``jsonl_block``) split the same way, so they agree on what a row is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

# Error codes of rows refused by the job itself (the fleet's refusals keep the fleet's codes).
INVALID_JSON = "invalid_json"
MISSING_ID = "missing_id"
INVALID_ID = "invalid_id"
DUPLICATE_ID = "duplicate_id"
EMPTY_TEXT = "empty_text"
NON_STRING_TEXT = "non_string_text"
INVALID_PROMPT_NAME = "invalid_prompt_name"


class CorpusError(Exception):
    """The job cannot go on (no input, an output folder in use, a fingerprint that changed)."""


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


def input_files(path: Path) -> tuple[str, list[str]]:
    """("json" | "parquet", the files) of INPUT: a file, or a folder of one kind of file."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    found = {kinds.get(p.suffix) for p in files}
    if not files or None in found or len(found) != 1:
        raise CorpusError(f"{path}: expected .jsonl or .parquet files (one kind), found "
                          f"{sorted(p.name for p in files)[:5] or 'nothing'}")
    return found.pop(), [str(p.resolve()) for p in files]


# JSON's whitespace: a line of only these holds no row (JSON Lines allows a "\r\n" line end).
JSON_BLANK = b" \t\r\n"


def jsonl_rows(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each row of a JSONL file: split at ``\n`` only, blank lines
    dropped. A file that is not UTF-8 stops the job (its rows' text cannot be told)."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if raw.strip(JSON_BLANK):
                try:
                    yield n, raw.removesuffix(b"\n").decode("utf-8")
                except UnicodeDecodeError as err:
                    raise CorpusError(f"{path}:{n} is not UTF-8 ({err.reason} at byte "
                                      f"{err.start} of the line): re-encode it") from None


def jsonl_lines(data: bytes) -> list[str]:
    """The rows of one JSONL file's bytes, split as ``jsonl_rows`` splits the file."""
    return [line.decode("utf-8") for line in data.split(b"\n") if line.strip(JSON_BLANK)]


def jsonl_block(files: Any) -> Any:
    """A Ray Data batch of whole JSONL files (``read_binary_files``: a ``bytes`` column) as a
    batch of their rows' lines (a ``text`` column), the input ``BatchEmbedder`` parses."""
    import pyarrow as pa

    lines = [ln for data in files.column("bytes").to_pylist() for ln in jsonl_lines(data)]
    return pa.table({"text": pa.array(lines, pa.string())})


def parse_line(line: str) -> dict[str, Any] | None:
    """One JSONL row as a dict, or None when the line is not a JSON object."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def missing(x: Any) -> bool:
    """Ray Data hands a missing value as None, or as NaN in a column it typed as float."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def id_kind(x: Any) -> str | None:
    """"str" or "int" for an id a part can hold; None for anything else (bool, float, list...)."""
    if isinstance(x, str):
        return "str" if x else None
    if isinstance(x, int) and not isinstance(x, bool) and -2 ** 63 <= x < 2 ** 63:
        return "int"  # (an int64 column)
    return None


def id_problem(x: Any, kind: str | None) -> tuple[str, str] | None:
    """(code, message) when ``x`` cannot be a row's id in a job whose ids are of ``kind``."""
    if missing(x) or x == "":
        return MISSING_ID, "the row has no id"
    got = id_kind(x)
    if got is None:
        return INVALID_ID, f"id {x!r} is not a string or an integer"
    if kind is not None and got != kind:
        return INVALID_ID, (f"id {x!r} is a {'string' if got == 'str' else 'number'}, but this "
                            f"corpus's ids are {'strings' if kind == 'str' else 'numbers'}")
    return None


def text_problem(text: Any, prompt_name: Any) -> tuple[str, str] | None:
    """(code, message) when a row's text or prompt name cannot be sent."""
    if missing(text):
        return EMPTY_TEXT, "the row has no text"
    if not isinstance(text, str):
        return NON_STRING_TEXT, f"the text is a {type(text).__name__}, not a string"
    if not text.strip():
        return EMPTY_TEXT, f"the text is empty ({text!r})"
    if not missing(prompt_name) and not isinstance(prompt_name, str):
        return INVALID_PROMPT_NAME, f"prompt_name {prompt_name!r} is not a string"
    return None


@dataclass(frozen=True)
class Refusal:
    """A row that ends in errors.jsonl. ``row`` ("file:line", "file:row") where it is known:
    always for the scan's refusals, which is how a resume tells whether one was written."""

    id: Any
    code: str
    message: str
    row: str | None = None

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "code": self.code, "message": self.message, "row": self.row}


@dataclass
class Scan:
    total: int = 0
    kind: str | None = None  # the ids' kind: "str" or "int" (the first valid id's)
    refusals: list[Refusal] = field(default_factory=list)
    duplicated: set[Any] = field(default_factory=set)  # ids on more than one row


def scan(kind: str, files: list[str]) -> Scan:
    """Count the rows and refuse the ones whose id cannot be used (see the module docstring)."""
    out = Scan()
    first: dict[Any, str] = {}  # id -> where it was first seen
    dups: dict[Any, list[str]] = {}
    for f in files:
        name = Path(f).name
        for where, x in _ids(kind, f, name, out):
            out.total += 1
            bad = id_problem(x, out.kind)
            if bad is not None:
                out.refusals.append(Refusal(None if bad[0] == MISSING_ID else x, *bad, where))
                continue
            out.kind = out.kind or id_kind(x)
            if x in first:
                dups.setdefault(x, [first[x]]).append(where)
            else:
                first[x] = where
    for x, places in dups.items():
        shown = ", ".join(places[:5]) + (f" and {len(places) - 5} more" if len(places) > 5 else "")
        msg = (f"id {x!r} is on {len(places)} rows ({shown}); none of them is embedded: which "
               "text the id stands for cannot be told")
        out.refusals.extend(Refusal(x, DUPLICATE_ID, msg, where) for where in places)
    out.duplicated = set(dups)
    return out


def _ids(kind: str, path: str, name: str, scan_: Scan) -> Iterator[tuple[str, Any]]:
    """(where, id) of each row of one file; a JSONL line that is not a JSON object is refused
    here (it has no id to key it by)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        if "id" not in names or "text" not in names:
            raise CorpusError(f"{path}: no {sorted({'id', 'text'} - set(names))} column (each "
                              "row needs id and text, and may have prompt_name)")
        for n, x in enumerate(pq.read_table(path, columns=["id"]).column("id").to_pylist(), 1):
            yield f"{name}:{n}", x
        return
    for n, line in jsonl_rows(path):
        row = parse_line(line)
        where = f"{name}:{n}"
        if row is None:
            scan_.total += 1
            scan_.refusals.append(Refusal(None, INVALID_JSON,
                                          f"line {n} is not a JSON object: {line[:60]!r}", where))
            continue
        yield where, row.get("id")
