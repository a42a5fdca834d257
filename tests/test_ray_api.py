"""Every Ray touch point exists in Ray 2.60.0 (CPU/CUDA stacks) and in Ray 2.55.1 (Ascend stack).

The Ascend stack pins ray[serve]==2.55.1 (pyproject's ``ascend`` extra): every Ray from 2.56.0 on
requires fastapi>=0.133.0, which vllm-ascend 0.23.0.post1's fastapi<0.124.0 excludes. Both
releases' sources are read with ``ast``: 2.60.0 from the venv (located with ``find_spec``), 2.55.1
from its wheel (``tests/support/reference_sources.py``), never imported. The list is data, in
``tests/support/ray_touch_points.py``; the checks mirror ``tests/test_vllm_api.py``'s (and reuse
its helpers), with base classes in the same file, constant values and source fragments added.
``test_a_260_only_name_would_fail`` shows a lookup really fails on a name 2.55.1 lacks;
``test_known_differences_are_as_documented`` keeps the list of behaviour differences honest.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from tests.support.ray_touch_points import (
    DEPLOYMENT_OPTIONS,
    KNOWN_DIFFERENCES,
    RAY_260_ONLY,
    TOUCH_POINTS,
    RayTouchPoint,
)
from tests.support.reference_sources import ray_2551_source
from tests.test_vllm_api import _class, _fields, _module_names, _params, _tree

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("deployments", "cluster", "monitoring")


def ray_260_source() -> Path:
    spec = importlib.util.find_spec("ray")  # locates the package without importing it
    assert spec is not None and spec.origin
    return Path(spec.origin).parent


@pytest.fixture(scope="module", params=["2.60.0", "2.55.1"])
def source(request) -> Path:
    return ray_260_source() if request.param == "2.60.0" else ray_2551_source()


def test_the_two_sources_are_the_two_releases():
    for root, version in ((ray_260_source(), "2.60.0"), (ray_2551_source(), "2.55.1")):
        text = (root / "_version.py").read_text()
        assert re.search(rf"^version = ['\"]{re.escape(version)}['\"]", text, re.MULTILINE), root


def _norm(fragment: str) -> str:
    return re.sub(r"\s+", " ", fragment).strip()


def _class_chain(tree: ast.Module, name: str) -> list[ast.ClassDef]:
    """The class and its bases defined in the same module (in MRO-ish order)."""
    out: list[ast.ClassDef] = []
    todo = [name]
    while todo:
        cls = _class(tree, todo.pop(0))
        if cls is None or cls in out:
            continue
        out.append(cls)
        for base in cls.bases:
            node = base.value if isinstance(base, ast.Subscript) else base  # Generic[T] bases
            if isinstance(node, ast.Name):
                todo.append(node.id)
    return out


def _module_def(tree: ast.Module, name: str) -> ast.AST | None:
    for n in tree.body:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return n
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                             for t in n.targets):
            return n
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) \
                and n.target.id == name:
            return n
    return None


def _member_def(classes: list[ast.ClassDef], member: str) -> ast.AST | None:
    for cls in classes:
        for n in cls.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member:
                return n
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == member
                                                 for t in n.targets):
                return n
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) \
                    and n.target.id == member:
                return n
    return None


def _constant(node: ast.AST) -> object:
    """The constant an assignment binds or a function returns (its first ``return``)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
        return node.value.value
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for n in ast.walk(node):
            if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant):
                return n.value.value
    return None


def check(root: Path, tp: RayTouchPoint) -> str | None:
    """None when ``tp`` holds in the Ray source tree at ``root``; else what is missing."""
    path = root / tp.file
    if not path.is_file():
        return f"{tp.file} does not exist"
    tree = _tree(path)
    head, _, member = tp.path.partition(".")
    if not head:  # file-wide source fragments
        text = _norm(ast.unparse(tree))
        missing = [c for c in tp.contains if _norm(c) not in text]
        return f"{tp.file} lacks {missing}" if missing else None
    if member:
        classes = _class_chain(tree, head)
        if not classes:
            return f"{tp.file} has no class {head}"
        node = _member_def(classes, member)
        if node is None:
            return f"class {head} has no member {member}"
    else:
        node = _module_def(tree, head)
        if node is None:
            return None if head in _module_names(tree) and not (tp.params or tp.value
                                                                  or tp.contains) \
                else f"{tp.file} has no {head}"
    if tp.params:
        if isinstance(node, ast.ClassDef):
            have = set().union(*(_fields(c) for c in _class_chain(tree, node.name)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            have = _params(node)
        else:
            return f"{tp.path} is not a class or function; cannot check {tp.params}"
        missing = sorted(set(tp.params) - have)
        if missing:
            return f"{tp.path} lacks {missing}"
    if tp.value is not None and _constant(node) != tp.value:
        return f"{tp.path} is {_constant(node)!r}, not {tp.value!r}"
    if tp.contains:
        text = _norm(ast.unparse(node))
        missing = [c for c in tp.contains if _norm(c) not in text]
        if missing:
            return f"{tp.path} lacks {missing}"
    return None


def _tp_id(tp: RayTouchPoint) -> str:
    return f"{tp.file}:{tp.path or '*'}" + (f"[{tp.contains[0][:30]}]" if tp.contains else "")


@pytest.mark.parametrize("tp", TOUCH_POINTS, ids=_tp_id)
def test_touch_point_exists(source, tp):
    assert check(source, tp) is None, f"Ray at {source}: {check(source, tp)} (used by {tp.used_by})"


def test_a_260_only_name_would_fail():
    """The check really looks: ``ReplicaUnavailableError`` (serve/exceptions.py) is new in 2.56+;
    code that caught it would fail this test's 2.55.1 run."""
    assert check(ray_260_source(), RAY_260_ONLY) is None
    assert "ReplicaUnavailableError" in (check(ray_2551_source(), RAY_260_ONLY) or "")
    assert check(ray_260_source(), RayTouchPoint("serve/handle.py", "DeploymentHandle.nope"))
    bad_value = RAY_260_ONLY._replace(path="NAMESPACE", file=(
        "_private/telemetry/open_telemetry_metric_recorder.py"), value="rayx")
    assert "not 'rayx'" in (check(ray_260_source(), bad_value) or "")


@pytest.mark.parametrize("diff", KNOWN_DIFFERENCES, ids=lambda d: d.touch_point.path)
def test_known_differences_are_as_documented(diff):
    """Each listed difference still holds in 2.60.0 and still does not in 2.55.1; when one stops
    being true (say the pins move), the list and the lead's version gates must be revisited."""
    assert check(ray_260_source(), diff.touch_point) is None, diff.differs
    assert check(ray_2551_source(), diff.touch_point) is not None, (
        f"no longer different in 2.55.1: {diff.differs}")


# -- the list covers what product code imports and configures ---------------------------------

def _ray_imports(path: Path) -> set[str]:
    """``ray.x.y:name`` for each ``from ray.x.y import name``; ``ray.x.y`` for ``import ray.x.y``."""
    out: set[str] = set()
    for n in ast.walk(_tree(path)):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == "ray"}
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ray":
            out |= {f"{n.module}:{a.name}" for a in n.names}
    return out


# Where each imported module or name is a touch point (file under ray/ and path in TOUCH_POINTS);
# plain ``import ray`` and ``from ray import serve`` are covered by the ray.* / serve.* entries.
IMPORT_TOUCH_POINTS = {
    "ray": None,
    "ray:serve": None,
    # 2.60 only, a KNOWN_DIFFERENCE: cluster/doctor.py's import falls back to PATH without it
    "ray.serve._private.haproxy:get_haproxy_binary": None,
    "ray.serve:Application": ("serve/__init__.py", "Application"),
    "ray.exceptions:ActorDiedError": ("exceptions.py", "ActorDiedError"),
    "ray.exceptions:ActorUnavailableError": ("exceptions.py", "ActorUnavailableError"),
    "ray.exceptions:RayActorError": ("exceptions.py", "RayActorError"),
    "ray.serve.exceptions:BackPressureError": ("serve/exceptions.py", "BackPressureError"),
    "ray.serve.exceptions:DeploymentUnavailableError":
        ("serve/exceptions.py", "DeploymentUnavailableError.message"),
    "ray.util:metrics": ("util/metrics.py", "Counter.__init__"),
    "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter":
        ("serve/_private/request_router/__init__.py", "PowerOfTwoChoicesRequestRouter"),
    **{f"ray.serve.request_router:{n}": ("serve/request_router.py", n)
       for n in ("PendingRequest", "ReplicaID", "RunningReplica")},
    "ray.util:get_node_ip_address": ("util/__init__.py", "get_node_ip_address"),
    "ray.util.state:list_actors": ("util/state/__init__.py", "list_actors"),
    "ray.experimental:internal_kv": ("experimental/internal_kv.py", "_internal_kv_put"),
    "ray._private:state": ("_private/state.py", "GlobalState.get_max_resources_from_cluster_config"),
    "ray._private:ray_constants": ("_private/ray_constants.py", "DEBUG_AUTOSCALING_STATUS"),
    "ray.dashboard.modules.serve.sdk:ServeSubmissionClient":
        ("dashboard/modules/serve/sdk.py", "ServeSubmissionClient.__init__"),
}


def test_every_ray_import_in_product_code_is_a_touch_point():
    listed = {(tp.file, tp.path) for tp in TOUCH_POINTS}
    found: dict[str, list[str]] = {}
    for folder in PRODUCT_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for imp in _ray_imports(path):
                found.setdefault(imp, []).append(str(path.relative_to(ROOT)))
    unknown = {imp: where for imp, where in found.items() if imp not in IMPORT_TOUCH_POINTS}
    assert not unknown, f"Ray imports with no touch point (add them to ray_touch_points): {unknown}"
    for imp, target in IMPORT_TOUCH_POINTS.items():
        assert target is None or target in listed, (imp, target)


def test_deployment_options_embedfleet_sets_are_listed(tmp_path):
    """The option names deployments/config/ray_options.py puts in its dicts, for every shipped config, are
    the ones checked (serve.deployment, Deployment.options, DeploymentSchema...)."""
    from embedfleet.deployments.config import ray_options as options
    from embedfleet.deployments.config.schema import CONFIG_DIR, load_config

    seen: set[str] = set()
    autoscaling: set[str] = set()
    actor: set[str] = set()
    for path in [*sorted(CONFIG_DIR.glob("*.yaml")), ROOT / "tests" / "configs" / "e2e-cpu.yaml"]:
        cfg_file = tmp_path / path.name  # as tests/test_vllm_api.py loads them
        cfg_file.write_text(path.read_text().replace("TINY_QWEN3", str(tmp_path)))
        cfg = load_config(cfg_file)
        dicts = [options.router_deployment_options(cfg), options.registry_deployment_options(cfg),
                 options.governor_deployment_options(cfg),
                 *(options.engine_deployment_options(cfg, m) for m in cfg.models)]
        for d in dicts:
            seen |= set(d)
            autoscaling |= set(d.get("autoscaling_config") or {})
            actor |= set(d.get("ray_actor_options") or {})
    assert seen, "no config loaded"
    from tests.support.ray_touch_points import AUTOSCALING_KEYS, RAY_ACTOR_OPTIONS

    assert seen <= set(DEPLOYMENT_OPTIONS), sorted(seen - set(DEPLOYMENT_OPTIONS))
    assert autoscaling <= set(AUTOSCALING_KEYS), sorted(autoscaling - set(AUTOSCALING_KEYS))
    assert actor <= set(RAY_ACTOR_OPTIONS), sorted(actor - set(RAY_ACTOR_OPTIONS))
