"""The prefix-cache policy table: every row the issue names, plus the edges around them."""

from __future__ import annotations

import pytest

from embedfleet.deployments.engine.prefix_cache_policy import (
    RULES,
    ModelFacts,
    PlatformFacts,
    PrefixCacheDecision,
    PrefixCacheRefused,
    resolve,
)

# Model types as model_facts derives them (see tests/test_model_facts.py for the derivation).
QWEN3_EMB = ModelFacts("Qwen3ForCausalLM", "causal", "LAST")
QWEN3_EMB_INT8 = ModelFacts("Qwen3ForCausalLM", "causal", "LAST", kv_cache_dtype="int8")
QWEN3_EMB_FP8 = ModelFacts("Qwen3ForCausalLM", "causal", "LAST", kv_cache_dtype="fp8")
BERT = ModelFacts("BertModel", "bidirectional", "MEAN")
BERT_CLS = ModelFacts("BertModel", "bidirectional", "CLS")
CAUSAL_MEAN = ModelFacts("Qwen2ForCausalLM", "causal", "MEAN")
CAUSAL_ALL = ModelFacts("InternLM2ForRewardModel", "causal", "ALL")

VLLM = "0.32.0"


def ascend(plugin: str | None) -> PlatformFacts:
    return PlatformFacts("ascend", VLLM, plugin)


CUDA = PlatformFacts("cuda", VLLM)
CPU = PlatformFacts("cpu", "0.32.0+cpu")

# (id, setting, model, platform, accept_risk, enabled, known_bad, reason substring)
CASES = [
    ("qwen3-ascend-0.17-off", "auto", QWEN3_EMB, ascend("0.17.0"), False, False, True,
     "vllm-ascend 0.17.0 < 0.18.0: pooling attention ignores the KV cache"),
    ("qwen3-ascend-0.13-off", "auto", QWEN3_EMB, ascend("0.13.0rc1"), False, False, True,
     "< 0.18.0"),
    ("qwen3-ascend-0.18rc-off", "auto", QWEN3_EMB, ascend("0.18.0rc1"), False, False, True,
     "0.18.0rc1 < 0.18.0"),
    ("qwen3-ascend-0.18-on", "auto", QWEN3_EMB, ascend("0.18.0"), False, True, False,
     "vllm-ascend 0.18.0"),
    ("qwen3-ascend-pinned-on", "auto", QWEN3_EMB, ascend("0.23.0.post1"), False, True, False,
     "prefix caching supported"),
    ("qwen3-ascend-0.18-int8-off", "auto", QWEN3_EMB_INT8, ascend("0.18.0"), False, False, True,
     '"C8"'),
    ("qwen3-ascend-0.18-fp8-on", "auto", QWEN3_EMB_FP8, ascend("0.18.0"), False, True, False,
     "KV cache fp8"),
    ("qwen3-ascend-plugin-missing-off", "auto", QWEN3_EMB, ascend(None), False, False, True,
     "vllm-ascend version unknown"),
    ("qwen3-ascend-plugin-garbage-off", "auto", QWEN3_EMB, ascend("not-a-version"), False, False,
     True, "'not-a-version' is unparseable"),
    ("bert-ascend-off", "auto", BERT, ascend("0.18.0"), False, False, True,
     "bidirectional attention"),
    ("bert-cuda-off", "auto", BERT, CUDA, False, False, True, "non-causal"),
    ("bert-cpu-off", "auto", BERT, CPU, False, False, True, "bidirectional attention"),
    ("bert-cls-cpu-off", "auto", BERT_CLS, CPU, False, False, True, "bidirectional"),
    ("causal-mean-cuda-off", "auto", CAUSAL_MEAN, CUDA, False, False, True,
     "MEAN pooling reads the hidden states of every token"),
    ("qwen3-cuda-on", "auto", QWEN3_EMB, CUDA, False, True, False,
     "causal attention with LAST pooling on vLLM 0.32.0 (cuda)"),
    ("qwen3-cpu-on", "auto", QWEN3_EMB, CPU, False, True, False, "(cpu): prefix caching supported"),
    ("causal-all-cpu-on", "auto", CAUSAL_ALL, CPU, False, True, False, "ALL pooling"),
    ("qwen3-cuda-old-vllm-off", "auto", QWEN3_EMB, PlatformFacts("cuda", "0.9.2"), False, False,
     True, "vLLM 0.9.2 < 0.10.1"),
    ("causal-all-old-vllm-off", "auto", CAUSAL_ALL, PlatformFacts("cuda", "0.11.0"), False, False,
     True, "< 0.12.0"),
    ("qwen3-unknown-platform-off", "auto", QWEN3_EMB, PlatformFacts("rocm", VLLM), False, False,  # type: ignore[arg-type]
     True, "no rule covers platform 'rocm'"),
    ("off-safe-cpu", "off", QWEN3_EMB, CPU, False, False, False, "disabled by config"),
    ("off-safe-ascend", "off", QWEN3_EMB, ascend("0.18.0"), True, False, False,
     "disabled by config"),
    ("off-bert-says-why", "off", BERT, CPU, False, False, True, "auto would also be off"),
    ("on-safe-cuda", "on", QWEN3_EMB, CUDA, False, True, False, "enabled by config"),
    ("on-ascend-0.17-accepted", "on", QWEN3_EMB, ascend("0.17.0"), True, True, True,
     "operator accepted the risk: vllm-ascend 0.17.0 < 0.18.0"),
    ("on-bert-accepted", "on", BERT, CPU, True, True, True, "operator accepted the risk"),
    ("auto-ignores-accept-risk", "auto", QWEN3_EMB, ascend("0.17.0"), True, False, True,
     "0.17.0 < 0.18.0"),
]


@pytest.mark.parametrize(
    "setting, model, platform, accept_risk, enabled, known_bad, reason",
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_policy_table(setting, model, platform, accept_risk, enabled, known_bad, reason):
    decision = resolve(setting, model, platform, accept_risk=accept_risk)
    assert isinstance(decision, PrefixCacheDecision)
    assert decision.enabled is enabled, decision.reason
    assert decision.known_bad is known_bad, decision.reason
    assert reason in decision.reason


@pytest.mark.parametrize(
    "model, platform, reason",
    [
        pytest.param(QWEN3_EMB, ascend("0.17.0"),
                     "vllm-ascend 0.17.0 < 0.18.0: pooling attention ignores the KV cache",
                     id="ascend-0.17"),
        pytest.param(QWEN3_EMB_INT8, ascend("0.18.0"), "int8", id="ascend-c8"),
        pytest.param(QWEN3_EMB, ascend(None), "vllm-ascend version unknown", id="plugin-unknown"),
        pytest.param(BERT, CPU, "bidirectional attention", id="bert-cpu"),
    ],
)
def test_on_over_known_bad_is_refused_with_the_reason(model, platform, reason):
    with pytest.raises(PrefixCacheRefused) as info:
        resolve("on", model, platform)
    err = info.value
    assert reason in err.reason
    assert reason in str(err)
    assert err.model is model and err.platform is platform
    # A refusal is a deployment decision, not a client error: it must not be caught as ValueError.
    assert not isinstance(err, ValueError)


@pytest.mark.parametrize("platform", [CPU, CUDA, ascend("0.17.0"), ascend("0.18.0"), ascend(None)])
@pytest.mark.parametrize("model", [QWEN3_EMB, QWEN3_EMB_INT8, BERT, CAUSAL_MEAN])
@pytest.mark.parametrize("accept_risk", [False, True])
def test_off_is_always_off(model, platform, accept_risk):
    decision = resolve("off", model, platform, accept_risk=accept_risk)
    assert not decision.enabled
    assert decision.reason.startswith("disabled by config")


def test_unknown_setting_is_a_programming_error():
    with pytest.raises(ValueError, match="prefix_cache='maybe'"):
        resolve("maybe", QWEN3_EMB, CPU)  # type: ignore[arg-type]


def test_table_shape():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names)), "rule names identify rows in logs; keep them unique"
    # The last row must catch everything, and refuse: unknown combinations are not safe.
    last = RULES[-1]
    assert last.verdict == "unsafe"
    assert last.when(QWEN3_EMB, PlatformFacts("tpu", VLLM))  # type: ignore[arg-type]
