"""Alternated A/B of ``router.http_ingress`` (Serve's Python proxy vs its HAProxy mode).

The setting lives in every Ray node's environment at ``ray start``, so one cluster cannot switch
it: each run starts the default local cluster with one setting (``embedfleet up --detach
--config``), runs the bench's ``online`` workload on it (one short text per request,
``--concurrency`` in flight, base64) and stops it. The settings alternate, ``--repeats`` times
each. Each run is timed and metered by the bench's own parts (``load_driver.timed_run``,
``peers.OpenAIHttpPeer``, ``process_cpu.CpuMeter``): texts/s, p50, and CPU-seconds per 1,000
texts of the whole cluster (``ray_cluster_scope.RayCluster``: every Ray process, HAProxy,
Prometheus) and, apart, of the load driver (this process).

    python -m embedfleet.benchmarks.ingress_ab --repeats 5 --out benchmarks/results/ingress-ab.json

It stops any Ray cluster on this machine (``embedfleet down``), as ``embedfleet up`` would join it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

MODES = ("serve_proxy", "haproxy")
CLI = str(Path(sys.executable).with_name("embedfleet"))
SUMMARY_KEYS = ("texts_per_s", "p50_ms", "cpu_s_per_1k", "driver_cpu_s_per_1k")


def ingress_config(mode: str, base: Path | None = None) -> dict[str, Any]:
    """The bundled local config (or ``base``) with ``router.http_ingress: mode``, validated."""
    from ..deployments.config.schema import DEFAULT_CONFIG_PATH, parse_config

    data = yaml.safe_load((base or DEFAULT_CONFIG_PATH).read_text())
    data.setdefault("router", {})["http_ingress"] = mode
    parse_config(data, f"ingress_ab:{mode}")  # what `embedfleet up --config` loads must validate
    return data


def online_workload(requests: int, model_dir: Any, max_len: int) -> tuple[Any, int]:
    """The bench's ``online`` workload with ``requests`` texts, and its token count."""
    from transformers import AutoTokenizer

    from .workloads import FULL, build

    w = build("online", replace(FULL, online=requests), max_len=max_len)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return w, sum(len(i) for i in tok(w.texts, add_special_tokens=True)["input_ids"])


async def online_run(port: int, model: str, workload: Any, tokens: int, repeat: int) -> dict:
    """One timed, metered run of ``workload`` against the local cluster (just started)."""
    from .load_driver import timed_run, warm_up
    from .peers import OpenAIHttpPeer
    from .process_cpu import CpuMeter, OwnProcess
    from .ray_cluster_scope import RayCluster
    from ..cluster.prometheus_server import PID_NAME
    from ..deployments.common.settings import settings

    peer = OpenAIHttpPeer("embedfleet", f"http://127.0.0.1:{port}", model, workload.concurrency)
    meter = CpuMeter({"peer": RayCluster(port, settings().state_dir / "prometheus" / PID_NAME),
                      "driver": OwnProcess(os.getpid(), "load driver (this process)")})
    try:
        await warm_up(peer, workload, 1, 20, workload.concurrency)
        rec = await timed_run(peer, workload, repeat=repeat, tokens=tokens, batch=1,
                              concurrency=workload.concurrency, cpu=meter)
    finally:
        await peer.close_client()
    if rec["error"]:
        raise RuntimeError(rec["error"])
    return rec


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the medians of texts/s, p50 and CPU over its runs."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[mode] = {k: round(statistics.median(r[k] for r in mine), 2)
                         for k in SUMMARY_KEYS if all(r.get(k) is not None for r in mine)
                         } | {"runs": len(mine)}
    return out


def build_report(command: list[str], workload: Any, runs: list[dict[str, Any]]) -> dict:
    return {"command": command, "requests": len(workload.texts),
            "workload": workload.description, "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> int:
    from ..deployments.config.schema import parse_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress-ab.json"))
    args = p.parse_args(argv)
    runs: list[dict[str, Any]] = []
    configs = {}  # written once per mode: every repeat of a mode starts the same cluster
    for mode in MODES:
        data = ingress_config(mode)
        configs[mode] = args.out.with_name(f"ingress-ab-{mode}.yaml")
        configs[mode].parent.mkdir(parents=True, exist_ok=True)
        configs[mode].write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = parse_config(data, "ingress_ab")  # the modes differ only in http_ingress
    m = cfg.models[0]
    workload, tokens = online_workload(args.requests, m.source.resolve(), m.max_model_len or 512)
    for repeat in range(args.repeats):
        for mode in MODES:
            subprocess.run([CLI, "up", "--detach", "--config", str(configs[mode])], check=True,
                           stdout=subprocess.DEVNULL)
            try:
                time.sleep(10)  # let start-up's own work (canary, first scrapes) settle
                r = asyncio.run(online_run(cfg.router.port, m.name, workload, tokens, repeat))
            finally:
                subprocess.run([CLI, "down"], check=False, stdout=subprocess.DEVNULL)
            runs.append({"mode": mode, **r})
            print(json.dumps({k: runs[-1].get(k) for k in ("mode", "repeat", *SUMMARY_KEYS)}),
                  flush=True)
    report = build_report(sys.argv, workload, runs)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
