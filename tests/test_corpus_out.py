"""The corpus job's output folder without a cluster: one writer per folder (the lock), parts that
are whole or absent (fsync'd before their rename; a corrupt one named and re-done), errors.jsonl
that survives a cut last line, and the scan that refuses rows by their ids before any call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedfleet.cluster import corpus_input as ci
from embedfleet.cluster import corpus_out as co
from embedfleet.cluster.corpus_input import CorpusError, Refusal


def part(out, ids, fingerprint="abc/float32/vllm/cpu", dim=4):
    n = len(ids)
    return co.write_part(out, ids, np.arange(n * dim, dtype=np.float32).reshape(n, dim),
                         np.arange(n) + 3, fingerprint)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it, far later)


# -- the lock ----------------------------------------------------------------------------------

def test_a_second_job_on_the_same_folder_is_refused_naming_the_owner(tmp_path):
    with co.OutLock(tmp_path):
        owner = json.loads((tmp_path / co.LOCK).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with pytest.raises(CorpusError, match=rf"another embed-corpus job writes to .*\(pid "
                                              rf"{os.getpid()} on {socket.gethostname()}"):
            co.OutLock(tmp_path).acquire()
    assert not (tmp_path / co.LOCK).exists()  # released on exit
    co.OutLock(tmp_path).acquire()  # and free for the next job


def test_a_lock_whose_pid_is_dead_on_this_host_is_taken_over_saying_so(tmp_path, capsys):
    stale = {"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}
    (tmp_path / co.LOCK).write_text(json.dumps(stale))
    lock = co.OutLock(tmp_path)
    lock.acquire()
    assert f"took over the lock of pid {stale['pid']}" in capsys.readouterr().err
    assert json.loads((tmp_path / co.LOCK).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [co.LOCK]  # no stale copy left
    lock.release()


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    (tmp_path / co.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": "elsewhere"}))
    with pytest.raises(CorpusError, match="on elsewhere"):
        co.OutLock(tmp_path).acquire()
    (tmp_path / co.LOCK).write_text("")  # cut while being written: nothing to judge it by
    past = os.path.getmtime(tmp_path / co.LOCK) - 10  # (a young one is read again: being written)
    os.utime(tmp_path / co.LOCK, (past, past))
    with pytest.raises(CorpusError, match="not a lock this job can read"):
        co.OutLock(tmp_path).acquire()


def test_a_lock_read_while_its_owner_writes_it_is_read_again(tmp_path):
    import threading

    (tmp_path / co.LOCK).write_text("")  # created, not yet written
    owner = {"pid": os.getpid(), "host": socket.gethostname()}
    threading.Timer(0.3, lambda: (tmp_path / co.LOCK).write_text(json.dumps(owner))).start()
    with pytest.raises(CorpusError, match=rf"another embed-corpus job .*\(pid {os.getpid()}"):
        co.OutLock(tmp_path).acquire()


def test_release_leaves_a_lock_it_does_not_own(tmp_path):
    lock = co.OutLock(tmp_path)
    lock.acquire()
    (tmp_path / co.LOCK).write_text(json.dumps({"pid": 1, "host": "h", "token": "other"}))
    lock.release()
    assert (tmp_path / co.LOCK).exists()


# -- parts -------------------------------------------------------------------------------------

def test_parts_are_fsynced_before_their_rename_and_read_back(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, type(tmp_path).rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(type(tmp_path), "rename",
                        lambda self, to: (events.append("rename"), real_rename(self, to))[1])
    assert part(tmp_path, ["a", "b"]) == 2
    assert events == ["fsync", "rename", "fsync"]  # the file, then the folder's entry
    assert part(tmp_path, ["c"]) == 1 and part(tmp_path, []) == 0  # no empty part
    assert not list(tmp_path.glob(".*"))  # renamed, no temporary left
    done, fingerprint = co.finished_parts(tmp_path)
    assert done == {"a", "b", "c"} and fingerprint == "abc/float32/vllm/cpu"
    table = pq.read_table(tmp_path)
    assert table.schema.field("embedding").type.list_size == 4
    assert sorted(table.column("tokens").to_pylist()) == [3, 3, 4]
    part(tmp_path, ["d"], fingerprint="zzz/float32/vllm/cpu")
    with pytest.raises(CorpusError, match="several fingerprints"):
        co.finished_parts(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_corrupt_part_is_named_moved_aside_and_its_rows_done_again(tmp_path, capsys, damage):
    part(tmp_path, ["a", "b"])
    part(tmp_path, ["c"])
    bad = next(p for p in tmp_path.glob(co.PART_GLOB)
               if pq.read_table(p).column("id").to_pylist() == ["c"])
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\0" * len(data))
    done, _ = co.finished_parts(tmp_path)
    assert done == {"a", "b"}  # "c" is sent again
    err = capsys.readouterr().err
    assert f"{bad.name} is truncated or corrupt" in err and "Traceback" not in err
    assert (tmp_path / co.CORRUPT / bad.name).exists() and not bad.exists()
    assert pq.read_table(tmp_path).num_rows == 2  # the hidden folder is not read as a part


# -- errors.jsonl ------------------------------------------------------------------------------

def test_errors_jsonl_drops_a_cut_last_line_and_keys_rows_by_id_or_position(tmp_path, capsys):
    log = co.ErrorLog(tmp_path)
    log.append([Refusal("x", "context_length_exceeded", "too long"),
                Refusal(None, "missing_id", "no id", "c.jsonl:4")])
    with open(tmp_path / co.ERRORS, "a") as f:
        f.write('{"id": "y", "code": "empty_te')  # a kill in the middle of a line
    log = co.ErrorLog(tmp_path)
    assert "partial line" in capsys.readouterr().err
    assert (log.ids, log.rows, log.lines) == ({"x"}, {"c.jsonl:4"}, 2)
    assert log.summary() == "context_length_exceeded 1, missing_id 1"
    assert (tmp_path / co.ERRORS).read_text().endswith("\n")
    lines = [json.loads(x) for x in (tmp_path / co.ERRORS).read_text().splitlines()]
    assert lines[0] == {"id": "x", "code": "context_length_exceeded", "message": "too long",
                        "row": None}
    (tmp_path / co.ERRORS).write_text("not json\n")
    with pytest.raises(CorpusError, match="errors.jsonl:1 is not one of this job's lines"):
        co.ErrorLog(tmp_path)


# -- the scan: ids, before any call ------------------------------------------------------------

def test_the_scan_counts_rows_and_refuses_bad_and_duplicate_ids_where_they_are(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join([
        '{"id": "d1", "text": "x"}', "", '{"id": "d2", "text": "y"}', "not json {",
        '{"text": "no id"}', '{"id": "d1", "text": "again"}', '{"id": 7, "text": "a number"}',
        '{"id": "", "text": "empty id"}', '["a", "list"]', '{"id": "d3", "text": 5}']) + "\n")
    (tmp_path / "b.jsonl").write_text('{"id": "d1", "text": "third"}\n')
    kind, files = ci.input_files(tmp_path)
    found = ci.scan(kind, files)
    assert found.total == 10 and found.kind == "str"  # the blank line is not a row
    got = {(r.code, r.row, r.id) for r in found.refusals}
    assert got == {("invalid_json", "a.jsonl:4", None), ("invalid_json", "a.jsonl:9", None),
                   ("missing_id", "a.jsonl:5", None), ("missing_id", "a.jsonl:8", None),
                   ("invalid_id", "a.jsonl:7", 7), ("duplicate_id", "a.jsonl:1", "d1"),
                   ("duplicate_id", "a.jsonl:6", "d1"), ("duplicate_id", "b.jsonl:1", "d1")}
    dup = next(r for r in found.refusals if r.code == "duplicate_id")
    assert "is on 3 rows (a.jsonl:1, a.jsonl:6, b.jsonl:1)" in dup.message
    assert found.duplicated == {"d1"}  # d3's non-string text is the worker's to refuse


def test_the_scan_reads_only_the_ids_of_parquet_and_needs_id_and_text(tmp_path):
    pq.write_table(pa.table({"id": [1, None, 3, 1], "text": ["a", "b", "c", "d"]}),
                   tmp_path / "c.parquet")
    found = ci.scan(*ci.input_files(tmp_path / "c.parquet"))
    assert found.total == 4 and found.kind == "int"
    assert sorted((r.code, r.row) for r in found.refusals) == [
        ("duplicate_id", "c.parquet:1"), ("duplicate_id", "c.parquet:4"),
        ("missing_id", "c.parquet:2")]
    pq.write_table(pa.table({"id": [1]}), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match=r"no \['text'\] column"):
        ci.scan(*ci.input_files(tmp_path / "c.parquet"))


def test_the_scan_and_the_workers_split_rows_at_newline_only(tmp_path):
    """JSON Lines: a row ends at "\n" only; U+2028, U+2029, U+0085, "\r" and the other
    characters str.splitlines breaks at stay inside their row. The scan (jsonl_rows, a line at a
    time) and the workers (jsonl_block over read_binary_files' whole files) split alike."""
    import random

    alphabet = ["a", "b", "\n", "\r", "\r\n", "\u2028", "\u2029", "\x85", " ", "\x0b",
                "\x1c", "é"]
    for seed in range(500):
        rng = random.Random(seed)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        (tmp_path / "a.jsonl").write_bytes(text.encode())
        want = [(k, line) for k, line in enumerate(text.split("\n"), 1)
                if line.strip(" \t\r")]
        got = list(ci.jsonl_rows(str(tmp_path / "a.jsonl")))
        assert got == want, repr(text)
        block = ci.jsonl_block(pa.table({"bytes": [text.encode()]}))
        assert [line for _, line in got] == block.column("text").to_pylist(), repr(text)


def test_a_row_holding_line_separators_in_its_strings_is_one_row(tmp_path):
    rows = [{"id": "a\u2028b", "text": "one\u2028two"}, {"id": "p", "text": "x\u2029y\x85z"},
            {"id": "c", "text": "plain"}]
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl").write_bytes(data)
    found = ci.scan(*ci.input_files(tmp_path))
    assert found.total == 3 and not found.refusals
    lines = ci.jsonl_block(pa.table({"bytes": [data]})).column("text").to_pylist()
    assert [ci.parse_line(ln) for ln in lines] == rows


def test_a_file_ray_data_cannot_decode_stops_the_job_before_any_call(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"id": "a", "text": "\xff"}\n')
    with pytest.raises(CorpusError, match="is not UTF-8"):
        ci.scan(*ci.input_files(tmp_path))


def test_input_files_take_one_kind_and_name_what_they_found(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    kind, files = ci.input_files(tmp_path)
    assert kind == "json" and [f.rsplit("/", 1)[1] for f in files] == ["a.jsonl", "b.jsonl"]
    (tmp_path / "c.parquet").write_bytes(b"")
    with pytest.raises(CorpusError, match="one kind"):
        ci.input_files(tmp_path)
    with pytest.raises(CorpusError, match="notes.txt"):
        (tmp_path / "notes.txt").write_text("x")
        ci.input_files(tmp_path / "notes.txt")
