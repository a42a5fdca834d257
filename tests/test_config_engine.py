"""``engine.kv_cache_dtype`` is one of vLLM's own KV-cache dtypes: vLLM 0.23's (the engine the
Ascend target runs, read from its source under .cache/reference) and accepted by the installed
vLLM; ``int8`` (not a vLLM cache dtype) is refused at load with the reason."""

from __future__ import annotations

import ast
from typing import get_args

import pytest

from embedfleet.deployments.config.schema import ConfigError, KvCacheDtype, parse_config
from tests.support.reference_sources import vllm_023_source

MODEL = {"name": "m", "source": {"path": "/models/m"}}


def _cache_dtypes(cache_py) -> set[str]:
    """``CacheDType``'s values, read from vllm/config/cache.py without importing it."""
    tree = ast.parse(cache_py.read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CacheDType"
                                                 for t in node.targets)):
            return {e.value for e in node.value.slice.elts}
    raise AssertionError(f"no CacheDType in {cache_py}")


def _with(dtype: str):
    return parse_config({"models": [{**MODEL, "engine": {"kv_cache_dtype": dtype}}]})


def test_the_schema_lists_vllm_023s_cache_dtypes_exactly():
    assert set(get_args(KvCacheDtype)) == _cache_dtypes(vllm_023_source() / "config" / "cache.py")


def test_every_listed_dtype_is_accepted_by_the_installed_vllm():
    import vllm.config.cache as installed

    assert set(get_args(KvCacheDtype)) <= set(get_args(installed.CacheDType))


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8_e5m2", "bfloat16", "int8_per_token_head"])
def test_vllm_dtypes_load(dtype):
    assert _with(dtype).models[0].engine.kv_cache_dtype == dtype


@pytest.mark.parametrize("dtype", ["int8", "C8"])
def test_int8_is_refused_with_where_ascends_c8_comes_from(dtype):
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*not one of vLLM's KV-cache dtypes.*"
                                          r"ModelSlim checkpoint"):
        _with(dtype)


def test_an_unknown_dtype_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        _with("fp4")
