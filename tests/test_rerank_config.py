"""The reranker table (engine/rerank_models.py) and the config's ``task: rerank``: a
Qwen3-Reranker without its hf_overrides is corrected (INFO line), wrong ones are refused with
the fix, and the engine gets what the config resolved."""

from __future__ import annotations

import logging

import pytest

from embedfleet.deployments.config.schema import ConfigError, parse_config
from embedfleet.deployments.engine.rerank_models import (FAMILIES, QWEN3_RERANKER_OVERRIDES,
                                                         OverrideRefused, family_for,
                                                         resolve_overrides)

QWEN3 = FAMILIES[0]


def _cfg(**model):
    base = {"name": "rr", "task": "rerank", "source": {"hub_id": "Qwen/Qwen3-Reranker-0.6B"}}
    return parse_config({"models": [{**base, **model}]})


def test_family_by_name_not_by_embedder_names():
    assert family_for(["Qwen/Qwen3-Reranker-8B"]) is QWEN3
    assert family_for(["/models/qwen3_reranker_4b"]) is QWEN3
    assert family_for(["Qwen/Qwen3-Embedding-8B"]) is None
    assert family_for(["x"], ["Qwen3ForCausalLM"]) is None  # an embedder has that too


def test_missing_overrides_are_filled_with_an_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="embedfleet.config"):
        cfg = _cfg()
    m = cfg.models[0]
    assert m.hf_overrides == QWEN3_RERANKER_OVERRIDES
    kw = cfg.engine_kwargs(m, enable_prefix_caching=False)
    assert kw["hf_overrides"] == QWEN3_RERANKER_OVERRIDES
    assert any("hf_overrides set to" in r.getMessage() for r in caplog.records)


def test_right_overrides_pass_and_extra_keys_stay():
    cfg = _cfg(hf_overrides={**QWEN3_RERANKER_OVERRIDES, "max_window_layers": 2})
    assert cfg.models[0].hf_overrides["max_window_layers"] == 2


@pytest.mark.parametrize("wrong, says", [
    ({**QWEN3_RERANKER_OVERRIDES, "architectures": ["Qwen3VLForSequenceClassification"]},
     "must be ['Qwen3ForSequenceClassification']"),
    ({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["yes", "no"]},
     "must be ['no', 'yes']"),
    ({"architectures": ["Qwen3ForSequenceClassification"]},
     "is_original_qwen3_reranker is '<missing>'"),
])
def test_wrong_overrides_are_refused_with_the_fix(wrong, says):
    with pytest.raises(ConfigError) as err:
        _cfg(hf_overrides=wrong)
    assert says in str(err.value)
    assert "Fix: hf_overrides:" in str(err.value)


def test_a_qwen3_reranker_served_as_an_embedder_is_refused():
    with pytest.raises(ConfigError, match="set task: rerank"):
        _cfg(task="embed")


def test_embedders_are_untouched():
    cfg = parse_config({"models": [{"name": "e", "source": {"hub_id": "Qwen/Qwen3-Embedding-8B"}}]})
    assert cfg.models[0].task == "embed" and cfg.models[0].hf_overrides is None
    assert "hf_overrides" not in cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False)


def test_resolve_overrides_unit():
    assert resolve_overrides(None, {"a": 1}) == ({"a": 1}, None)
    with pytest.raises(OverrideRefused):
        resolve_overrides(QWEN3, {})


def test_template_puts_the_instruction_first():
    t = QWEN3.template
    a = t.render("q1", "d1")
    b = t.render("q2", "d2")
    shared = a[:len(a) - len("q1\n<Document>: d1") - len(
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")]
    assert b.startswith(shared) and "<Instruct>: Given a web search query" in shared
    assert a.endswith("<Document>: d1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<Instruct>: mine\n" in t.render("q", "d", "mine")
