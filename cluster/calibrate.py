"""`embedfleet calibrate`: measure what a model's engine takes of its card, worst step included.

The governor's band (``governor_law.params_for_profile``) and the simulation
(``benchmarks/governor_sim.py``) read a card profile (``deployments/engine/card_profile.py``).
Numbers from documents are assumptions; this command takes them from the card itself:

1. start the model's engine as a replica would (the config's engine arguments; prefix caching
   off, so every token of the worst step is computed);
2. read the card at idle (the runtime's total, the KV pool, the weights, what is held outside
   the pool);
3. run the worst step the config allows, ``REPEATS`` times: ``max_num_seqs`` sequences of
   ``max_model_len`` tokens, bounded by ``max_num_batched_tokens`` (2 x 32K on the 910B config),
   and read the peak outside the pool and the allocator's retry/OOM counters after each;
4. judge (``judge``): the worst step must leave ``safety_margin_bytes`` of the card and the
   allocator must not have failed. Then the profile is written where the governor looks
   (``default_profile_path``) and the exit status is 0. Otherwise nothing is written, the exit
   status is 2, and the verdict names the ``kv_cache_memory_bytes`` or
   ``gpu_memory_utilization`` that would leave the margin.

On CPU the card is the stand-in of ``card_memory.CpuCardModel`` (``platform.cpu_card_memory_bytes``)
under the same arithmetic as a replica's readings. ``--json`` prints one JSON object, last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..deployments.config.schema import EmbedfleetConfig, ModelConfig, load_config
from ..deployments.engine.card_profile import (AllocatorCounters, CardProfile,
                                               WorstStep, default_profile_path,
                                               save_profile)

# The worst step twice on a card: the second run meets the allocator's state after the first
# (cached segments, fragmentation). The CPU stand-in has no allocator state to meet: once.
REPEATS = {"ascend": 2, "cuda": 2, "cpu": 1}
PROBE_TIMEOUT_S = 120.0  # one memory probe waits at most one engine step (a long one on CPU)
# The margin when none is given: what calibration cannot reproduce (fragmentation over hours,
# runtime growth), 1 GiB on a card (the shipped 910B profile's), a tenth of what the pool leaves
# on a small card (the CPU stand-in's few hundred MiB).
MARGIN_CAP_BYTES = 1 << 30
MARGIN_SHARE = 0.10
MIB = 1 << 20


def worst_step(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> WorstStep:
    """Full-length sequences, as many as one step takes (at least one: a sequence of
    max_model_len is always admitted, chunked prefill splitting it across steps if needed)."""
    per_seq = max_model_len
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens // per_seq))
    return WorstStep(sequences=seqs, tokens=seqs * per_seq, tokens_per_sequence=per_seq)


def default_margin(card_total: int, kv_pool: int) -> int:
    return int(min(MARGIN_CAP_BYTES, MARGIN_SHARE * (card_total - kv_pool)))


@dataclass(frozen=True)
class Verdict:
    fits: bool
    reason: str
    fit: dict[str, float | int] | None = None  # the engine setting that would leave the margin


def judge(*, card_total: int, kv_pool: int, worst_peak: int, margin: int, ooms: int,
          gpu_memory_utilization: float | None, kv_cache_memory_bytes: int | None) -> Verdict:
    """Fits when the worst step leaves at least ``margin`` of the card and the allocator never
    failed; otherwise the pool must give up the deficit, said in the config's own knob."""
    headroom = card_total - kv_pool - worst_peak
    if headroom >= margin and ooms == 0:
        return Verdict(True, f"the worst step leaves {headroom / MIB:.0f} MiB of the card, "
                             f"above the {margin / MIB:.0f} MiB safety margin")
    deficit = margin - headroom
    why = (f"the allocator failed {ooms} time(s) during the worst step" if ooms else
           f"the worst step leaves {headroom / MIB:.0f} MiB of the card, below the "
           f"{margin / MIB:.0f} MiB safety margin")
    deficit = max(deficit, 1)
    new_pool = kv_pool - deficit
    if new_pool <= 0:
        return Verdict(False, f"{why}; even without a KV pool the worst step would not leave "
                              "the margin: lower max_num_batched_tokens or max_model_len")
    if kv_cache_memory_bytes is not None or gpu_memory_utilization is None:
        fit = new_pool // MIB * MIB  # whole MiB, rounded down
        return Verdict(False, f"{why}; kv_cache_memory_bytes: {fit} would fit",
                       {"kv_cache_memory_bytes": fit})
    # vLLM sizes the pool as card x utilisation minus what its profile run planned outside it,
    # so the pool shrinks by exactly what the utilisation gives up.
    util = math.floor((gpu_memory_utilization - deficit / card_total) * 100) / 100
    if util <= 0:
        return Verdict(False, f"{why}; no gpu_memory_utilization fits: lower "
                              "max_num_batched_tokens or max_model_len")
    return Verdict(False, f"{why}; gpu_memory_utilization: {util:.2f} would fit",
                   {"gpu_memory_utilization": util})


@dataclass(frozen=True)
class Measurement:
    card_total: int
    kv_pool: int
    weights: int
    idle_outside: int
    worst_peak: int
    retries: int
    ooms: int
    step: WorstStep
    engine_version: str
    step_s: float
    repeats: int


async def measure(cfg: EmbedfleetConfig, m: ModelConfig, *, repeats: int | None = None,
                  log=print) -> Measurement:
    """Start the engine, read the card at idle, run the worst step, read it again; the engine
    and its processes are gone when this returns."""
    from ..deployments.engine.card_memory import CpuCardModel, reading_from_probe
    from ..deployments.engine.lifecycle import DEFAULT_ENGINE_FACTORY, EngineLifecycle

    life = EngineLifecycle(DEFAULT_ENGINE_FACTORY,
                           lambda on: cfg.engine_kwargs(m, enable_prefix_caching=on))
    cpu = (CpuCardModel(cfg.platform.cpu_card_memory_bytes) if cfg.platform.kind == "cpu"
           else None)
    repeats = repeats or REPEATS[cfg.platform.kind]
    log(f"starting the engine of {m.name} ...")
    engine = life.build(False)
    try:
        async def read(idle: bool):
            mem = await engine.memory(PROBE_TIMEOUT_S, idle=idle)
            return mem, reading_from_probe(mem.probe, mem.kv.pool_bytes, mem.kv.peak_usage, cpu)

        mem, idle = await read(True)
        weights = int(mem.probe.get("weights", 0))
        info = engine.info
        step = worst_step(m.engine.max_num_seqs, m.engine.max_num_batched_tokens,
                          info.max_model_len)
        rng = random.Random(0)
        low = min(1000, info.vocab_size // 2)  # past the special and reserved ids
        peak, t0 = idle, time.monotonic()
        for k in range(repeats):
            # Distinct random ids: no prefix is shared, every token is computed.
            ids = [[rng.randrange(low, info.vocab_size) for _ in range(step.tokens_per_sequence)]
                   for _ in range(step.sequences)]
            log(f"worst step {k + 1}/{repeats}: {step.sequences} x {step.tokens_per_sequence} "
                "tokens ...")
            await engine.embed(ids, request_id=f"calibrate-{k}")
            _, after = await read(False)
            peak = max(peak, after, key=lambda r: r.live_bytes)
            last = after
        retries, ooms = last.allocator.rise_since(idle.allocator)
        idle_outside = max(idle.live_bytes, weights)  # the weights are outside the pool
        return Measurement(
            card_total=idle.total_bytes, kv_pool=idle.kv_pool_bytes, weights=weights,
            idle_outside=idle_outside, worst_peak=max(peak.live_bytes, idle_outside),
            retries=retries, ooms=ooms, step=step, engine_version=info.engine_version,
            step_s=(time.monotonic() - t0) / repeats, repeats=repeats)
    finally:
        life.shutdown(engine)
        engine = None  # noqa: F841 - the last reference: vLLM's __del__ must not run at exit
        gc.collect()


def build_profile(cfg: EmbedfleetConfig, m: ModelConfig, x: Measurement,
                  margin: int) -> CardProfile:
    from ..deployments.engine.vllm_api import stack_versions

    v = stack_versions()
    plugin = v.vllm_ascend if cfg.platform.kind == "ascend" else None
    return CardProfile(
        source="measured", platform=cfg.platform.kind, app_name=cfg.app_name, model=m.name,
        model_source=str(m.source.resolve()), engine_version=v.vllm, plugin_version=plugin,
        measured_at=datetime.now(timezone.utc), card_total_bytes=x.card_total,
        kv_pool_bytes=x.kv_pool, weights_bytes=x.weights, idle_outside_pool_bytes=x.idle_outside,
        worst_step_peak_bytes=x.worst_peak,
        headroom_bytes=x.card_total - x.kv_pool - x.worst_peak, safety_margin_bytes=margin,
        allocator=AllocatorCounters(num_alloc_retries=x.retries, num_ooms=x.ooms),
        worst_step=x.step, gpu_memory_utilization=m.engine.gpu_memory_utilization,
        notes={"card_total_bytes": "the runtime's total" if cfg.platform.kind != "cpu" else
               "the CPU card stand-in's capacity (platform.cpu_card_memory_bytes)",
               "worst_step": f"run {x.repeats} time(s), {x.step_s:.2f} s each"})


def _pick_model(cfg: EmbedfleetConfig, name: str | None) -> ModelConfig:
    if name is not None:
        try:
            return cfg.model(name)
        except KeyError:
            raise SystemExit(f"no model {name!r} in the config; it serves "
                             f"{', '.join(m.name for m in cfg.models)}") from None
    if len(cfg.models) > 1:
        raise SystemExit(f"the config serves {len(cfg.models)} models "
                         f"({', '.join(m.name for m in cfg.models)}): pick one with --model")
    return cfg.models[0]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..deployments.engine.card_memory import total_mismatch

    cfg = load_config(args.config)
    m = _pick_model(cfg, args.model)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    try:
        x = asyncio.run(measure(cfg, m, log=log))
    except Exception as exc:  # the engine did not start or died: say so, not a traceback
        print(f"calibrate {m.name}: {type(exc).__name__}: {exc}\n(calibrate needs the card to "
              "itself: run it before `embedfleet up`, or where no replica holds the card)",
              file=sys.stderr)
        return 1
    margin = args.margin_bytes if args.margin_bytes is not None else default_margin(
        x.card_total, x.kv_pool)
    v = judge(card_total=x.card_total, kv_pool=x.kv_pool, worst_peak=x.worst_peak, margin=margin,
              ooms=x.ooms, gpu_memory_utilization=m.engine.gpu_memory_utilization,
              kv_cache_memory_bytes=cfg.engine_kwargs_pool_bytes(m))
    profile = build_profile(cfg, m, x, margin)
    path = Path(args.out) if args.out else default_profile_path(cfg.app_name, m.name)
    written = str(save_profile(profile, path)) if v.fits else None
    mismatch = (total_mismatch(x.card_total, cfg.platform.card_memory_bytes)
                if cfg.platform.kind != "cpu" else None)
    out: dict[str, Any] = {
        "model": m.name, "platform": cfg.platform.kind, "profile": written,
        "weights_bytes": x.weights, "idle_outside_pool_bytes": x.idle_outside,
        "safety_margin_bytes": margin, "allocator": profile.allocator.model_dump(),
        "worst_step": profile.worst_step.model_dump(), "step_s": round(x.step_s, 3),
        "reason": v.reason, "fit": v.fit, "card_total_warning": mismatch,
        "card_total_bytes": x.card_total, "kv_pool_bytes": x.kv_pool,
        "worst_step_peak_bytes": x.worst_peak, "headroom_bytes": profile.headroom_bytes,
        "verdict": "fits" if v.fits else "refused"}
    if args.json:
        print(json.dumps(out))
    else:
        for key in ("card_total_bytes", "kv_pool_bytes", "weights_bytes",
                    "idle_outside_pool_bytes", "worst_step_peak_bytes", "headroom_bytes",
                    "safety_margin_bytes"):
            print(f"{key}: {out[key]} ({out[key] / MIB:.1f} MiB)")
        print(f"allocator over the worst step: {out['allocator']}; worst step "
              f"{out['worst_step']}, {out['step_s']} s")
        if mismatch:
            print(f"warning: {mismatch}")
        print(f"verdict: {out['verdict']}: {v.reason}")
        print(f"profile written to {written}" if written else
              "no profile written: the governor keeps the configured band")
    return 0 if v.fits else 2


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="start a model's engine, run the worst step the config "
                       "allows, and write the card profile the governor reads at start")
    p.add_argument("--config", help="embedfleet config YAML (default: the local CPU one)")
    p.add_argument("--model", help="which served model (required if the config has several)")
    p.add_argument("--margin-bytes", type=int, default=None,
                   help="headroom the worst step must leave (default: min(1 GiB, a tenth of "
                   "the card outside the KV pool))")
    p.add_argument("--out", help="write the profile here (default: where the governor looks, "
                   "<state dir>/profiles/<app>--<model>.json)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on the last line (progress goes to stderr)")
    p.set_defaults(func=cmd_calibrate)
