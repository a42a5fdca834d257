"""The corpus job without a cluster: a worker's calls (prompt runs on the bulk lane, the
``--long-input`` mode on every call, 429s retried, a row's refusal costing none of its call's
other rows), and whole jobs on a corpus with long, empty, broken and duplicate-id rows, killed
and resumed, with their exit statuses.

The app's Serve handle and Ray Data are stand-ins (tests/support/standin_corpus_fleet.py); the
live job runs in tests/test_e2e_corpus.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from embedfleet.cluster import corpus_out as co
from embedfleet.cluster import embed_corpus as ec
from embedfleet.deployments.common.errors import ModelNotFound, Overloaded, UnsupportedParameter
from tests.support.standin_corpus_fleet import (FINGERPRINT, StandInHandle, Killed, embedder,
                                                in_process_rest, arrow_block, tokens_of,
                                                vector_of)

LONG = "word " * 30  # 32 tokens: over the stand-in's 16, under its 64 in all
HUGE = "word " * 80  # 82 tokens: over the stand-in's bound in every mode


def settings(batch_size=4, long_input=None, kind="parquet", id_kind="str", max_retry_s=5.0,
             chunk_above=None):
    return ec.JobSettings("app", "m", batch_size, 2, max_retry_s, long_input, kind, id_kind,
                          chunk_above)


def rows_of(table: pa.Table) -> tuple[dict, dict]:
    """(embedded id -> vector, refused id -> code) of a worker's output."""
    d = table.to_pylist()
    return ({r["id"]: r["embedding"] for r in d if r["code"] is None},
            {r["id"]: r["code"] for r in d if r["code"] is not None})


# -- one worker ------------------------------------------------------------------------------

def test_a_block_is_sent_in_runs_of_one_prompt_on_the_bulk_lane_skipping_finished_ids():
    handle = StandInHandle()
    block = arrow_block({"id": ["a", "b", "c", "d", "e"], "text": ["t1", "t2", "t3", "t4", "t5"],
                         "prompt_name": ["q", "q", "q", None, "q"]})
    out = embedder(handle, settings(batch_size=2), skip=frozenset({"b"}))(block)
    assert [(c.texts, c.prompt_name, c.lane) for c in handle.calls] == [
        (["t1", "t3"], "q", "bulk"), (["t4"], None, "bulk"), (["t5"], "q", "bulk")]
    embedded, refused = rows_of(out)
    assert list(embedded) == ["a", "c", "d", "e"] and not refused
    assert out.column("tokens").to_pylist() == [3, 3, 3, 3]
    assert set(out.column("fingerprint").to_pylist()) == {FINGERPRINT}


@pytest.mark.parametrize("mode", [None, "reject", "truncate", "chunk"])
def test_the_long_input_mode_goes_with_every_call(mode):
    handle = StandInHandle()
    out = embedder(handle, settings(long_input=mode))(
        arrow_block({"id": ["s", "l"], "text": ["short text", LONG]}))
    assert {c.long_input for c in handle.calls} == {mode}
    embedded, refused = rows_of(out)
    if mode in (None, "reject"):  # the stand-in model's policy is reject
        assert list(embedded) == ["s"] and refused == {"l": "context_length_exceeded"}
    else:
        assert embedded["l"] == vector_of(LONG, mode) and not refused


@pytest.mark.parametrize("chunk_above", [None, "max_model_len", "always"])
def test_the_chunk_above_choice_goes_with_every_call(chunk_above):
    handle = StandInHandle()
    out = embedder(handle, settings(long_input="chunk", chunk_above=chunk_above))(
        arrow_block({"id": ["s", "l"], "text": ["short text", LONG]}))
    assert handle.calls and {c.chunk_above for c in handle.calls} == {chunk_above}
    assert list(rows_of(out)[0]) == ["s", "l"]


def test_a_refused_chunk_above_stops_the_job_instead_of_refusing_every_row(tmp_path,
                                                                           monkeypatch, capsys):
    """Outside chunk mode (the stand-in model's policy is reject) the fleet refuses chunk_above
    with a 400 naming no input: that is about every row, so the job stops (exit 1) after one
    call, not bisecting each call down to its rows and refusing them all."""
    src, out = tmp_path / "c.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps({"id": i, "text": f"t {i}"}) + "\n" for i in range(8)))
    handle = StandInHandle()
    assert job(src, out, handle, chunk_above="always", monkeypatch=monkeypatch) == \
        ec.EXIT_FAILED
    assert "chunk_above applies to chunked inputs" in capsys.readouterr().err
    assert len(handle.calls) <= 2 and not (out / co.ERRORS).exists()  # one call per in-flight


def test_a_named_refusal_costs_one_call_and_none_of_the_calls_other_rows():
    handle = StandInHandle()
    texts = ["a b", LONG, "c d", LONG, "e f", "g h"]
    out = embedder(handle, settings(batch_size=6))(
        arrow_block({"id": [f"r{i}" for i in range(6)], "text": texts}))
    embedded, refused = rows_of(out)
    assert refused == {"r1": "context_length_exceeded", "r3": "context_length_exceeded"}
    assert {k: v for k, v in embedded.items()} == {
        f"r{i}": vector_of(texts[i], "reject") for i in (0, 2, 4, 5)}
    assert len(handle.calls) == 3  # 1 + one per refused row, each without the rows refused
    assert [len(c.texts) for c in handle.calls] == [6, 5, 4]
    message = out.filter(pc.equal(out.column("id"), "r1")).column("message")[0].as_py()
    assert message.startswith("the text has 32 tokens")  # not the call's own "input[1]"


def test_a_refusal_of_the_whole_call_is_bisected_down_to_its_row():
    handle = StandInHandle(max_chars=400)  # the 401-character text is too large alone
    texts = [f"t{i}" for i in range(7)] + ["x" * 401]
    out = embedder(handle, settings(batch_size=8))(
        arrow_block({"id": [f"r{i}" for i in range(8)], "text": texts}))
    embedded, refused = rows_of(out)
    assert refused == {"r7": "request_limit_exceeded"} and len(embedded) == 7
    assert len(handle.calls) <= 2 * 3 + 1  # ~2 log2(8) calls, not one per row


def test_a_refused_prompt_name_refuses_its_run_and_a_job_level_refusal_stops_the_job():
    handle = StandInHandle([UnsupportedParameter("model 'm' has no prompt template 'zz'",
                                                 param="prompt_name")])
    out = embedder(handle, settings())(arrow_block(
        {"id": ["a", "b", "c"], "text": ["x", "y", "z"], "prompt_name": ["zz", "zz", None]}))
    embedded, refused = rows_of(out)
    assert refused == {"a": "unsupported_parameter", "b": "unsupported_parameter"}
    assert list(embedded) == ["c"] and len(handle.calls) == 2  # no bisection of a shared cause
    handle = StandInHandle([ModelNotFound("model 'm' does not exist", param="model")])
    with pytest.raises(ec.CorpusError, match=r"refused the call starting at id 'a' \(404 "
                                             r"model_not_found\)"):
        embedder(handle, settings())(arrow_block({"id": ["a"], "text": ["x"]}))


def test_a_429_is_retried_after_its_retry_after_until_max_retry_s():
    handle = StandInHandle([Overloaded("bulk queue full", retry_after_s=0.01)])
    out = embedder(handle, settings(id_kind="int"))(
        arrow_block({"id": [7, 8], "text": ["x", "y"]}))
    assert len(handle.calls) == 2 and rows_of(out)[0].keys() == {7, 8}
    handle = StandInHandle([Overloaded("full", retry_after_s=0.2)] * 5)
    with pytest.raises(ec.CorpusError, match="could not be served for 0.3s"):
        embedder(handle, settings(max_retry_s=0.3))(arrow_block({"id": ["a"], "text": ["x"]}))


def test_texts_that_cannot_be_sent_are_refused_without_a_call_and_jsonl_lines_parsed():
    lines = ['{"id": "a", "text": "fine"}', '{"id": "b", "text": ""}', '{"id": "c", "text": 5}',
             '{"id": "d"}', '{"id": "e", "text": "   "}', "broken {",
             '{"id": "f", "text": "x", "prompt_name": 3}', '{"text": "no id"}',
             '{"id": "g", "text": "skipped: a duplicate"}', '{"id": 9, "text": "wrong kind"}']
    handle = StandInHandle()
    out = embedder(handle, settings(kind="json"), skip=frozenset({"g"}))(
        arrow_block({"text": lines}))
    embedded, refused = rows_of(out)
    assert list(embedded) == ["a"] and [c.texts for c in handle.calls] == [["fine"]]
    # broken lines, missing / wrong-kind ids and duplicates were refused by the scan, by row
    assert refused == {"b": "empty_text", "c": "non_string_text", "d": "empty_text",
                       "e": "empty_text", "f": "invalid_prompt_name"}


# -- whole jobs --------------------------------------------------------------------------------

def corpus(path, n=40):
    """n rows, with long (every 7th), empty, non-string, broken, id-less and duplicate rows."""
    rows = []
    for i in range(n):
        text = LONG if i % 7 == 3 else (HUGE if i == 20 else f"passage number {i}")
        rows.append(json.dumps({"id": f"doc-{i:03d}", "text": text}))
    rows[5] = json.dumps({"id": "doc-005", "text": ""})
    rows[9] = json.dumps({"id": "doc-009", "text": ["not", "a", "string"]})
    rows[12] = '{"id": "doc-012", "text": "cut'
    rows[15] = json.dumps({"text": "no id"})
    rows[30] = json.dumps({"id": "doc-001", "text": "a second doc-001"})
    path.write_text("\n".join(rows) + "\n")
    return path


def job(src, out, handle, mode=None, kill_after=None, monkeypatch=None, batch=4,
        chunk_above=None):
    monkeypatch.setattr(ec, "_embed_rest", in_process_rest(handle, kill_after))
    args = argparse.Namespace(input=str(src), out=str(out), model="m", app="app", address=None,
                              workers=1, batch_size=batch, inflight=2, max_retry_s=5.0,
                              long_input=mode, chunk_above=chunk_above)
    return ec.cmd_embed_corpus(args)


def where_rows_ended(out) -> tuple[list, list]:
    ids = pq.read_table(sorted(out.glob(co.PART_GLOB))).column("id").to_pylist() \
        if list(out.glob(co.PART_GLOB)) else []
    errors = [json.loads(x) for x in (out / co.ERRORS).read_bytes().split(b"\n")[:-1]]
    return ids, errors


@pytest.mark.parametrize("mode", ["reject", "truncate", "chunk"])
def test_every_row_ends_in_exactly_one_place_across_a_kill_and_resume(tmp_path, monkeypatch,
                                                                      capsys, mode):
    src, out = corpus(tmp_path / "c.jsonl"), tmp_path / "out"
    with pytest.raises(Killed):
        job(src, out, StandInHandle(), mode, kill_after=2, monkeypatch=monkeypatch)
    # the kill came after 2 parts and their refusals; a kill cuts errors.jsonl's last line too
    with open(out / co.ERRORS, "a") as f:
        f.write('{"id": "doc-0')
    (out / co.LOCK).write_text(json.dumps({"pid": 2 ** 22 + 17, "host": socket.gethostname()}))
    assert len(list(out.glob(co.PART_GLOB))) == 2
    handle = StandInHandle()
    status = job(src, out, handle, mode, monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert "took over the lock" in err and "partial line" in err
    ids, errors = where_rows_ended(out)
    refused = {e["id"] for e in errors if e["id"] is not None}
    long_ids = {f"doc-{i:03d}" for i in range(40) if i % 7 == 3}
    want_refused = {"doc-005": "empty_text", "doc-009": "non_string_text",
                    "doc-020": "context_length_exceeded", "doc-001": "duplicate_id"}
    if mode == "reject":
        want_refused.update(dict.fromkeys(long_ids, "context_length_exceeded"))
    got = {e["id"]: e["code"] for e in errors if e["id"] is not None}
    assert got == want_refused
    assert sorted(e["code"] for e in errors if e["id"] is None) == ["invalid_json", "missing_id"]
    assert sum(e["code"] == "duplicate_id" for e in errors) == 2  # both doc-001 rows
    # exactly once: 40 rows = parts + errors.jsonl lines, no id in both, none twice
    assert len(ids) == len(set(ids)) and len(ids) + len(errors) == 40
    assert not set(ids) & refused
    assert status == ec.EXIT_REFUSED
    # the resume sent only what the killed run had not decided
    sent = [t for c in handle.calls for t in c.texts]
    assert not {f"passage number {i}" for i in range(16)} & set(sent)
    table = pq.read_table(sorted(out.glob(co.PART_GLOB)))
    by_id = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()))
    assert by_id["doc-002"] == vector_of("passage number 2", mode)
    if mode != "reject":
        assert by_id["doc-010"] == vector_of(LONG, mode)


def test_exit_0_when_every_row_is_embedded_and_a_rerun_sends_nothing(tmp_path, monkeypatch,
                                                                     capsys):
    src, out = tmp_path / "c.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps({"id": i, "text": f"t {i}"}) + "\n" for i in range(10)))
    assert job(src, out, StandInHandle(), monkeypatch=monkeypatch) == ec.EXIT_OK
    assert "holds 10 of 10 rows embedded and 0 refused" in capsys.readouterr().out
    assert not (out / co.LOCK).exists()
    handle = StandInHandle()
    assert job(src, out, handle, monkeypatch=monkeypatch) == ec.EXIT_OK and not handle.calls
    ids = pq.read_table(sorted(out.glob(co.PART_GLOB))).column("id").to_pylist()
    assert sorted(ids) == list(range(10)) and not (out / co.ERRORS).exists()


def test_exit_1_when_the_job_cannot_finish_and_its_summary_when_it_can(tmp_path, monkeypatch,
                                                                       capsys):
    src, out = corpus(tmp_path / "c.jsonl"), tmp_path / "out"
    handle = StandInHandle([ModelNotFound("model 'm' does not exist", param="model")])
    assert job(src, out, handle, monkeypatch=monkeypatch) == ec.EXIT_FAILED
    assert "error: the fleet refused the call" in capsys.readouterr().err
    with co.OutLock(out):  # another job holds the folder
        assert job(src, out, StandInHandle(), monkeypatch=monkeypatch) == ec.EXIT_FAILED
        assert f"pid {os.getpid()}" in capsys.readouterr().err
    assert job(src, out, StandInHandle(), monkeypatch=monkeypatch) == ec.EXIT_REFUSED
    summary = capsys.readouterr().out
    assert ("holds 27 of 40 rows embedded and 13 refused (context_length_exceeded 7, "
            "duplicate_id 2, empty_text 1, invalid_json 1, missing_id 1, non_string_text 1"
            in summary), summary


def test_rows_holding_line_separators_arrive_whole_and_once(tmp_path, monkeypatch):
    """U+2028, U+2029 and U+0085 are legal raw in a JSON string (issue 39: str.splitlines cut
    such rows in two, each half refused as invalid JSON). Each row is embedded whole (the
    stand-in's vector holds the text's length), ids once, across a rerun."""
    src, out = tmp_path / "c.jsonl", tmp_path / "out"
    texts = {f"d{i}": f"line one{sep}line two {i}" for i, sep in
             enumerate(["\u2028", "\u2029", "\x85", "\u2028\u2029\x85", " "])}
    rows = [{"id": k, "text": t} for k, t in texts.items()]
    rows.append({"id": "sep\u2028id", "text": "\u2029"})  # refused (blank text) by its whole id
    src.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    assert job(src, out, StandInHandle(), monkeypatch=monkeypatch) == ec.EXIT_REFUSED
    ids, errors = where_rows_ended(out)
    assert sorted(ids) == sorted(texts) and len(ids) == len(set(ids))
    assert [(e["id"], e["code"]) for e in errors] == [("sep\u2028id", "empty_text")]
    table = pq.read_table(sorted(out.glob(co.PART_GLOB)))
    by_id = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()))
    assert all(by_id[k] == vector_of(t, "reject") for k, t in texts.items())
    handle = StandInHandle()  # the rerun finds every row decided, its refusal included
    assert job(src, out, handle, monkeypatch=monkeypatch) == ec.EXIT_REFUSED and not handle.calls
    assert where_rows_ended(out)[1] == errors


def test_a_parquet_corpus_with_null_and_repeated_ids_and_texts(tmp_path, monkeypatch):
    src, out = tmp_path / "c.parquet", tmp_path / "out"
    ids = list(range(30)) + [None, 4]
    texts = [LONG if i % 10 == 2 else f"text {i}" for i in range(30)] + ["x", "again"]
    texts[6] = None
    pq.write_table(pa.table({"id": ids, "text": texts, "other": ["-"] * 32}), src)
    assert job(src, out, StandInHandle(), "chunk", monkeypatch=monkeypatch) == ec.EXIT_REFUSED
    parts, errors = where_rows_ended(out)
    assert sorted(parts) == sorted(set(range(30)) - {4, 6})  # the long rows chunked
    assert sorted((e["id"], e["code"], e["row"]) for e in errors if e["id"] is not None) == [
        (4, "duplicate_id", "c.parquet:32"), (4, "duplicate_id", "c.parquet:5"),
        (6, "empty_text", None)]
    assert [(e["code"], e["row"]) for e in errors if e["id"] is None] == [
        ("missing_id", "c.parquet:31")]


def test_progress_shows_rows_done_refused_texts_per_s_and_an_eta(capsys):
    p = ec.Progress(total=100, done=10, refused=2)
    p.add(30, 5, 300, final=True)
    line = capsys.readouterr().err
    assert "45/100 rows (45.0%) · 7 refused ·" in line and "texts/s · ETA" in line


def test_tokens_of_the_stand_in_are_what_the_job_stores(tmp_path, monkeypatch):
    src, out = tmp_path / "c.jsonl", tmp_path / "out"
    src.write_text(json.dumps({"id": "a", "text": "one two three"}) + "\n")
    job(src, out, StandInHandle(), monkeypatch=monkeypatch)
    assert pq.read_table(out / next(p.name for p in out.glob(co.PART_GLOB))).column(
        "tokens").to_pylist() == [tokens_of("one two three")]


def test_the_reason_a_worker_stopped_the_job_reaches_the_user():
    try:
        try:
            raise ec.CorpusError("the call starting at id 'x' could not be served")
        except ec.CorpusError as err:
            raise RuntimeError("UserCodeException") from err
    except RuntimeError as wrapped:
        assert ec.corpus_error(wrapped) == "the call starting at id 'x' could not be served"
    # Ray keeps only the text of a remote cause: the last CorpusError line is the reason.
    remote = RuntimeError("ray::MapWorker() (pid=1)\n  File ...\nembedfleet.cluster."
                          "corpus_input.CorpusError: the fleet refused the call\n")
    assert ec.corpus_error(remote) == "the fleet refused the call"
    assert ec.corpus_error(ValueError("a bug")) is None


@pytest.mark.parametrize("argv", [["c.jsonl", "--out", "o"],  # no --model
                                  ["c.jsonl", "--model", "m", "--out", "o", "--long-input", "cut"],
                                  ["c.jsonl", "--model", "m", "--out", "o", "--bogus"]])
def test_a_bad_command_line_exits_1_not_2_which_means_refused_rows(argv, capsys):
    from embedfleet.cluster.cli import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["embed-corpus", *argv])
    assert stop.value.code == ec.EXIT_FAILED == 1
    assert "embed-corpus: error:" in capsys.readouterr().err
    args = build_parser().parse_args(["embed-corpus", "c.jsonl", "--model", "m", "--out", "o"])
    assert args.long_input is None and args.chunk_above is None  # the model's own policy


def test_chunk_above_is_an_option_that_needs_chunk_mode(tmp_path, capsys):
    from embedfleet.cluster.cli import build_parser

    base = ["embed-corpus", str(tmp_path / "c.jsonl"), "--model", "m", "--out", str(tmp_path)]
    args = build_parser().parse_args([*base, "--chunk-above", "always", "--long-input", "chunk"])
    assert (args.chunk_above, args.long_input) == ("always", "chunk")
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([*base, "--chunk-above", "sometimes"])
    assert stop.value.code == ec.EXIT_FAILED
    # refused before anything is read or started, naming both options
    args = build_parser().parse_args([*base, "--chunk-above", "always", "--long-input",
                                      "truncate"])
    assert ec.cmd_embed_corpus(args) == ec.EXIT_FAILED
    assert "--chunk-above applies to chunked texts" in capsys.readouterr().err


def test_the_exit_statuses_are_in_the_help(capsys):
    from embedfleet.cluster.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["embed-corpus", "--help"])
    out = capsys.readouterr().out
    assert "--long-input {reject,truncate,chunk}" in out
    for status in ("0  every row is embedded", "2  the job finished, and some rows are refused",
                   "1  the job could not finish"):
        assert status in out
