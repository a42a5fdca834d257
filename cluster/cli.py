"""The `embedfleet` command: up, down, deploy, render, status, prefix-cache, verify, doctor, bench."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from pydantic import ValidationError

from . import calibrate, doctor, embed_corpus, local, status

from .verify import command as verify
from .monitoring_stack import start_monitoring, stop_monitoring
from .render import load_serve_yaml, render_yaml, serve_config
from ..deployments.config.schema import ConfigError, EmbedfleetConfig, load_config
from ..deployments.config.router import (RouterConfig, is_loopback, keys_required,
                                         open_bind_refusal)
from ..deployments.config.ray_options import ray_head_env
from ..deployments.common.settings import settings


def _config(args: argparse.Namespace) -> EmbedfleetConfig:
    return _load(args)[1]


def _load(args: argparse.Namespace) -> tuple[dict[str, Any], EmbedfleetConfig]:
    """(Serve config to deploy, embedfleet config) from --serve-config or --config, with
    --cards and --host applied. Refused (``ConfigError``) when what would be deployed binds
    beyond loopback with no API keys and no explicit ``router.allow_unauthenticated``."""
    if getattr(args, "serve_config", None):
        serve_cfg, cfg = load_serve_yaml(args.serve_config)
    else:
        cfg = load_config(args.config)
        serve_cfg = None
    if getattr(args, "cards", None):
        cfg = cfg.model_copy(update={"cards": args.cards})
    if host := getattr(args, "host", None):
        try:  # validated again: the bind decides whether keys are required
            router = RouterConfig.model_validate({**cfg.router.model_dump(), "host": host})
        except ValidationError as err:
            raise ConfigError(f"--host {host}: " + "; ".join(
                str(e["msg"]).removeprefix("Value error, ") for e in err.errors())) from None
        cfg = cfg.model_copy(update={"router": router})
        if serve_cfg is not None:
            serve_cfg["http_options"]["host"] = host
            serve_cfg["applications"][0]["args"]["config"]["router"]["host"] = host
    serve_cfg = serve_cfg or serve_config(cfg)
    bind = (serve_cfg.get("http_options") or {}).get("host", "0.0.0.0")
    if why := open_bind_refusal(cfg.router, bind):
        raise ConfigError(f"refused: {why}")
    return serve_cfg, cfg


def _endpoint(cfg: EmbedfleetConfig) -> str:
    host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "::") else cfg.router.host
    return f"http://{host}:{cfg.router.port}"


def describe_bind(serve_cfg: dict[str, Any], cfg: EmbedfleetConfig) -> str:
    """One line on where the HTTP ingress listens and whether it asks for keys."""
    http = serve_cfg.get("http_options") or {}
    host, port = http.get("host", "0.0.0.0"), http.get("port", cfg.router.port)
    where = ("loopback only: this machine" if is_loopback(host)
             else "every interface" if host in ("0.0.0.0", "::") else "that address")
    keys = ("API keys required" if keys_required(cfg.router)
            else "NO API keys (router.allow_unauthenticated)" if not is_loopback(host)
            else "no API keys")
    return f"HTTP ingress binds {host}:{port} ({where}); {keys}"


def _deploy_and_wait(serve_cfg: dict[str, Any], cfg: EmbedfleetConfig, dashboard: str) -> None:
    print(describe_bind(serve_cfg, cfg))
    local.rest_deploy(dashboard, serve_cfg)
    endpoint = _endpoint(cfg)
    print(f"deployed application '{cfg.app_name}'; waiting until every model has a ready replica")
    body = local.wait_ready(endpoint, settings().ready_timeout_s)
    _wait_settled(cfg, settings().ready_timeout_s)
    print(f"ready: {json.dumps(body.get('models'))}")
    print(f"endpoint: {endpoint}/v1/embeddings   (models: {endpoint}/v1/models)")


def _wait_settled(cfg: EmbedfleetConfig, timeout_s: float) -> None:
    """After /ready: wait out a rolling update, so `up` returns on the new config's replicas."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = status.collect(app=cfg.app_name)
        if apps and apps[0].settled:
            return
        time.sleep(3)
    print("warning: replicas still starting or stopping; see `embedfleet status`")


def unplaceable(cfg: EmbedfleetConfig) -> str | None:
    """Why a local head (which cannot grow) can never make every model ready, or None.

    Each engine replica takes one card, so the models' ``min_replicas`` must fit in ``cards``;
    otherwise `up` would wait its whole ``ready_timeout_s`` for a card that never comes."""
    need = sum(m.replicas.min_replicas for m in cfg.models)
    if need <= cfg.cards:
        return None
    each = ", ".join(f"{m.name}: {m.replicas.min_replicas}" for m in cfg.models
                     if m.replicas.min_replicas)
    return (f"the models' min_replicas add up to {need} cards ({each}), but the local cluster "
            f"has cards={cfg.cards} {cfg.platform.card_resource} card(s) and cannot grow: lower "
            f"min_replicas or raise cards (--cards)")


def unreachable_max_warnings(cfg: EmbedfleetConfig, cards: float) -> list[str]:
    """One warning per model whose ``max_replicas`` a cluster of ``cards`` that cannot grow
    never reaches: the other models' ``min_replicas`` hold their cards for good. A model left
    no card at all is answered 503 at once (the registry's ``never``), not held."""
    from ..deployments.fleet.placement import unreachable_max

    reach = unreachable_max({m.name: (m.replicas.min_replicas, m.replicas.max_replicas)
                             for m in cfg.models}, int(cards))
    out = []
    for m in cfg.models:
        if m.name not in reach:
            continue
        others = ", ".join(f"{o.name}: {o.replicas.min_replicas}" for o in cfg.models
                           if o is not m and o.replicas.min_replicas)
        n = reach[m.name]
        what = ("never gets a card, and a request to it is answered 503 at once" if n == 0
                else f"runs at most {n} replica(s)")
        out.append(f"warning: model '{m.name}' can never reach max_replicas="
                   f"{m.replicas.max_replicas}: the cluster's {cards:g} "
                   f"{cfg.platform.card_resource} card(s) cannot grow and the other models' "
                   f"min_replicas ({others}) hold their cards for good, so it {what}; raise "
                   f"cards or lower their min_replicas")
    return out


def running_cluster_cards(resource: str) -> float | None:
    """The running cluster's cards when Ray says it cannot grow; None when it can, or when the
    cluster cannot be read from here (then nothing is checked, and `deploy` says so)."""
    import ray

    from ..deployments.fleet.placement import cluster_can_grow

    try:
        status.connect(None)
        total = ray.cluster_resources().get(resource, 0)
    except Exception as err:  # not on a node of the cluster: the deploy itself goes by REST
        print(f"note: could not read the cluster's cards ({err}); max_replicas not checked",
              file=sys.stderr)
        return None
    return None if cluster_can_grow(resource, total) else total


def keys_missing_here(cfg: EmbedfleetConfig) -> str | None:
    """Why the API keys the config names cannot be loaded on this machine, or None. `up` runs
    every node here (its nodes inherit this environment), so an ingress replica would fail to
    start for the same reason: say it now rather than after the wait for /ready."""
    from ..deployments.ingress.auth import KeysError, load_keys

    try:
        load_keys(cfg.router.api_keys_file, cfg.router.api_keys_env, [m.name for m in cfg.models])
    except KeysError as err:
        return f"{err} (every ingress replica would refuse to start)"
    return None


def cmd_up(args: argparse.Namespace) -> int:
    serve_cfg, cfg = _load(args)
    if (why := unplaceable(cfg) or keys_missing_here(cfg)) is not None:
        print(f"embedfleet up: refused: {why}", file=sys.stderr)
        return 2
    for warning in unreachable_max_warnings(cfg, cfg.cards):  # a local head cannot grow
        print(warning, file=sys.stderr)
    local.start_head(cfg.cards, cfg.platform.card_resource, cfg.nodes, ray_head_env(cfg))
    prom = start_monitoring(cfg)
    if prom:
        print(f"prometheus: {prom} (scraping Ray's metrics service discovery)")
    _deploy_and_wait(serve_cfg, cfg, local.dashboard_url(None))  # the local head's dashboard is on loopback
    if args.detach:
        return 0
    print("running; press Ctrl-C to stop the cluster")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    import ray

    ray.shutdown()  # the status reads' driver (status.connect), before its cluster goes
    return cmd_down(args)


def cmd_down(args: argparse.Namespace) -> int:
    if stop_monitoring():
        print("stopped prometheus")
    local.stop_head()
    print("stopped the local Ray head (and Serve with it)")
    time.sleep(2)  # replicas' reapers kill their engines within a second of the replica's death
    from ..deployments.engine.reaper import sweep_orphans

    if n := sweep_orphans():
        print(f"killed {n} orphaned engine process(es)")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    serve_cfg, cfg = _load(args)
    if (cards := running_cluster_cards(cfg.platform.card_resource)) is not None:
        for warning in unreachable_max_warnings(cfg, cards):
            print(warning, file=sys.stderr)
    _deploy_and_wait(serve_cfg, cfg, local.dashboard_url(args.address))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    cfg = _config(args)
    # Flags that only mean something for one kind of manifest are refused elsewhere, not ignored.
    only = {"--image": (args.image, ("kuberay", "ray_cluster")),
            "--example": (args.example, ("kuberay", "ray_cluster")),
            "--node-selector": (args.node_selector, ("kuberay",)),
            "--head-address": (args.head_address, ("ray_cluster",)),
            "--worker-address": (args.worker_address, ("ray_cluster",))}
    for flag, (value, kinds) in only.items():
        if value and not any(getattr(args, k) for k in kinds):
            why = (" (Ray's cluster launcher has no node selector: its nodes are the "
                   "--worker-address hosts)" if flag == "--node-selector" else "")
            raise ConfigError(f"{flag} applies to "
                              f"{' / '.join('--' + k.replace('_', '-') for k in kinds)} only{why}")
    if args.kuberay or args.ray_cluster:
        from .manifests import cluster_spec, render_cluster_launcher, render_rayservice

        if cfg.platform.kind != "ascend":
            raise ConfigError(f"--kuberay/--ray-cluster render 910B manifests; this config has "
                              f"platform.kind={cfg.platform.kind!r} (use an ascend config)")
        spec = cluster_spec(cfg, image=args.image, head_address=args.head_address,
                            worker_addresses=args.worker_address or (),
                            node_selector=dict(args.node_selector or ()), example=args.example)
        sys.stdout.write(render_rayservice(cfg, spec) if args.kuberay
                         else render_cluster_launcher(cfg, spec))
    else:
        sys.stdout.write(render_yaml(cfg))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..benchmarks.bench import main as bench_main  # vLLM and matplotlib only when benchmarking

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser, serve: bool = False) -> argparse.ArgumentParser:
        group = sp.add_mutually_exclusive_group()
        group.add_argument("--config", help="embedfleet config YAML (default: the local CPU one)")
        group.add_argument("--serve-config", help="a Serve config rendered by `embedfleet "
                           "render` (possibly edited): deployed as is") if serve else None
        return sp

    up = with_config(sub.add_parser("up", help="start a local cluster, deploy, wait until ready"),
                     serve=True)
    up.add_argument("--cards", type=int, help="logical cards of the local Ray head")
    up.add_argument("--detach", action="store_true", help="return once ready; leave it running")
    up.add_argument("--host", help="interface the HTTP ingress binds (overrides router.host; "
                    "beyond loopback needs API keys or router.allow_unauthenticated)")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop the local cluster").set_defaults(func=cmd_down)
    dep = with_config(sub.add_parser("deploy", help="deploy to an existing Ray cluster"),
                      serve=True)
    dep.add_argument("--address", required=True,
                     help="Ray dashboard address (http://host:8265) or head host")
    dep.set_defaults(func=cmd_deploy)
    ren = with_config(sub.add_parser("render", help="print the Serve config YAML"))
    kind = ren.add_mutually_exclusive_group()
    kind.add_argument("--kuberay", action="store_true",
                      help="a KubeRay RayService manifest instead (ascend configs)")
    kind.add_argument("--ray-cluster", action="store_true",
                      help="a Ray cluster-launcher YAML for 910B nodes instead (ascend configs)")
    from .manifests import address_flag, image_flag, node_selector_flag

    # Overrides of the config's `cluster` section; without an image (and, for --ray-cluster,
    # head and worker addresses) from either, the render is refused unless --example.
    ren.add_argument("--image", type=image_flag, metavar="REF",
                     help="container image of every node (overrides cluster.image)")
    ren.add_argument("--head-address", type=address_flag, metavar="HOST",
                     help="--ray-cluster: head node IP or host name (overrides "
                     "cluster.head_address)")
    ren.add_argument("--worker-address", type=address_flag, action="append", metavar="HOST",
                     help="--ray-cluster: a worker node IP or host name; repeat per node "
                     "(replaces cluster.worker_addresses)")
    ren.add_argument("--node-selector", type=node_selector_flag, action="append",
                     metavar="KEY=VALUE", help="--kuberay: a node label the pods must match; "
                     "repeat per label (merged over cluster.node_selector, key by key)")
    ren.add_argument("--example", action="store_true",
                     help="fill a missing image / addresses with documentation placeholders "
                     "(how cluster/examples/ is rendered); not to apply as is")
    ren.set_defaults(func=cmd_render)
    status.add_parsers(sub)
    verify.add_parser(sub)
    doctor.add_parser(sub)
    calibrate.add_parser(sub)
    embed_corpus.add_parser(sub)
    # prefix_chars="+": `bench` has no options of its own, so every --flag (and --help) reaches
    # embedfleet.benchmarks.bench's parser untouched.
    bench = sub.add_parser("bench", help="compare embedfleet with vLLM and Infinity "
                           "(`embedfleet bench --help`)", add_help=False, prefix_chars="+")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return p


def quiet_ray_logs() -> None:
    """Keep the terminal to what embedfleet says: Serve's INFO lines from this driver process
    (long-poll clients, handles) and Ray's NPU-probe traceback on nodes without CANN
    (local.without_npu_probe_noise says why that one is noise) are not for the operator."""
    import logging

    # A filter, not a level: Serve resets its logger's level when a driver first connects.
    logging.getLogger("ray.serve").addFilter(lambda record: record.levelno >= logging.WARNING)
    logging.getLogger("ray._private.accelerators.npu").addFilter(
        lambda record: local._NPU_PROBE_START not in record.getMessage())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_ray_logs()
    if args.command in ("up", "down", "deploy", "status", "prefix-cache", "embed-corpus"):
        local.ensure_token_auth()
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
