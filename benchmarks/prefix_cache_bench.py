"""The `prefix-cache` comparison: bare vLLM on a causal model, prefix caching on vs off.

The workload is `shared-instruction` at full length (a 768-token instruction + a short query;
MiniLM's 256 tokens would cap it), on the tiny random-weight Qwen3 that the tests build
(``benchmarks/tiny_qwen3.py``: Qwen3ForCausalLM, LAST pooling - the shape prefix caching is
for). Both engines are up at once and alternate per repeat, like the peers of the main comparison.

The ratio is measured, never assumed. A 2-layer, 128-wide model makes per-request overhead
(tokenising, scheduling, IPC) a large share of the time, so next to texts/s the report carries
the engine's own counters per run: prompt vs prefix-cached tokens (how much compute the cache
removed), and the engine's queue, prefill and end-to-end time per sequence (where the time went).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from .load_driver import timed_run, warm_up
from .peers import VllmInProcessPeer
from .report import MIN_COSINE, min_cosine, ratio
from .workloads import Sizes, build

ROOT = Path(__file__).resolve().parent.parent
TINY_QWEN3_DIR = ROOT / ".cache" / "models" / "tiny-qwen3"
MODEL_NAME = "tiny-qwen3"
VARIANTS = {"on": True, "off": False}


def tiny_qwen3_config(model_dir: Path) -> Any:
    """The tiny Qwen3 as tests/configs/e2e-cpu.yaml serves it (4096 tokens, 128 MiB KV cache)."""
    from ..deployments.config.schema import parse_config

    return parse_config({
        "platform": {"kind": "cpu"},
        "models": [{"name": MODEL_NAME, "source": {"path": str(model_dir)},
                    "max_model_len": 4096,
                    "engine": {"max_num_batched_tokens": 16384,
                               "kv_cache_memory_bytes": 134217728}}],
    }, "prefix-cache bench")


def engine_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One run's share of vLLM's cumulative counters, per sequence where that reads better."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    seqs = d.get("vllm:request_prompt_tokens_count", 0.0)
    if not seqs:
        return {"available": False}
    prompt = d.get("vllm:prompt_tokens_total", 0.0)
    cached = d.get("vllm:prompt_tokens_cached_total", 0.0)

    def per_seq_ms(name: str) -> float | None:
        v = d.get(f"vllm:{name}_sum")
        return round(1000 * v / seqs, 3) if v is not None else None

    return {
        "available": True, "sequences": int(seqs), "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "computed_tokens": int(d.get("vllm:request_prefill_kv_computed_tokens_sum",
                                     prompt - cached)),
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "queue_ms_per_seq": per_seq_ms("request_queue_time_seconds"),
        "prefill_ms_per_seq": per_seq_ms("request_prefill_time_seconds"),
        "e2e_ms_per_seq": per_seq_ms("e2e_request_latency_seconds"),
    }


SEQS = "vllm:request_prompt_tokens_count"  # finished sequences, as the engine counts them


async def _settled_counters(peer: VllmInProcessPeer, sequences: float | None = None,
                            timeout_s: float = 10.0) -> dict[str, float]:
    """The engine's counters once the last requests' stats are in: vLLM records them in its
    output loop, a moment after the results reach the caller. Waits until ``sequences`` are
    counted (or, without it, until two readings agree), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = peer.engine_counters()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = peer.engine_counters()
        if (now.get(SEQS, 0.0) >= sequences) if sequences is not None else now == last:
            return now
        last = now
    return last


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_variants(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in VARIANTS:
        rs = [r for r in runs if r["variant"] == v and r["error"] is None]
        eng = [r["engine"] for r in rs if r["engine"].get("available")]
        out[v] = {"repeats": len(rs),
                  "texts_per_s": _median([r["texts_per_s"] for r in rs]),
                  "tokens_per_s": _median([r["tokens_per_s"] for r in rs]),
                  "p50_ms": _median([r["p50_ms"] for r in rs]),
                  "p99_ms": _median([r["p99_ms"] for r in rs]),
                  **{k: _median([e.get(k) for e in eng]) for k in
                     ("cached_share", "computed_tokens", "queue_ms_per_seq",
                      "prefill_ms_per_seq", "e2e_ms_per_seq")}}
    out["on_over_off"] = ratio(out["on"]["texts_per_s"], out["off"]["texts_per_s"])
    # What the cache could give at most if only prefill compute mattered.
    out["computed_tokens_off_over_on"] = ratio(out["off"]["computed_tokens"],
                                               out["on"]["computed_tokens"])
    out["goal"] = 3.0
    out["goal_met"] = (out["on_over_off"] or 0) >= out["goal"]
    return out


async def run_prefix_cache(*, sizes: Sizes, repeats: int, batch: int, concurrency: int,
                           seed: int, progress: Any, overall: Any) -> dict[str, Any]:
    """Build the model if needed, run both engines alternately, return the report section."""
    from transformers import AutoTokenizer

    from .tiny_qwen3 import build_tiny_qwen3

    model_dir = build_tiny_qwen3(TINY_QWEN3_DIR)
    cfg = tiny_qwen3_config(model_dir)
    m = cfg.models[0]
    workload = build("prefix-cache", sizes, max_len=m.max_model_len, batch=batch, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = sum(len(i) for i in tok(workload.texts, add_special_tokens=True)["input_ids"])
    peers = {v: VllmInProcessPeer(f"prefix cache {v}",
                                  cfg.engine_kwargs(m, enable_prefix_caching=on))
             for v, on in VARIANTS.items()}
    section: dict[str, Any] = {
        "model": MODEL_NAME, "model_dir": str(model_dir),
        "engine_kwargs": {v: p.engine_kwargs for v, p in peers.items()},
        "workload_params": workload.params, "texts": len(workload.texts), "tokens": tokens,
        "runs": [], "status": "ok"}
    probes: dict[str, list[Any]] = {}
    try:
        for v, p in peers.items():
            progress.console.print(f"prefix-cache: starting tiny-qwen3 engine, cache {v}")
            await p.start()
            if p.engine.info.prefix_caching != VARIANTS[v]:
                raise RuntimeError(f"engine reports prefix_caching={p.engine.info.prefix_caching}"
                                   f" for the '{v}' variant")
        order = list(VARIANTS)
        reqs = -(-len(workload.texts) // batch)
        for rep in range(repeats):
            for v in order[rep % 2:] + order[:rep % 2]:  # alternate which goes first
                p = peers[v]
                task = progress.add_task(f"prefix-cache · {v} · repeat {rep + 1}", total=reqs)
                await warm_up(p, workload, batch, sizes.warmup_requests if rep == 0 else 1,
                              concurrency)
                before = await _settled_counters(p)
                run = await timed_run(p, workload, repeat=rep, tokens=tokens, batch=batch,
                                      concurrency=concurrency,
                                      on_done=lambda t=task: progress.advance(t))
                run["variant"] = v
                run["engine"] = engine_deltas(before, await _settled_counters(
                    p, before.get(SEQS, 0.0) + len(workload.texts)))
                e = run["engine"]
                progress.console.print(
                    f"  prefix-cache {v:<3} #{rep + 1}: "
                    + (f"{run['texts_per_s']:8.1f} texts/s  p50 {run['p50_ms']:8.1f} ms  "
                       f"cached {e.get('cached_share') or 0:.0%} of prompt tokens"
                       if run["error"] is None else f"[red]{run['error']}[/red]"))
                if rep == 0:  # after the timed run, so it cannot warm anything for it
                    probes[v] = await p.embed(workload.probe, workload)
                section["runs"].append(run)
                progress.remove_task(task)
                progress.advance(overall)
    except Exception as exc:  # noqa: BLE001 - the main comparison's results still get written
        section.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        for p in peers.values():
            await p.stop()
    if len(probes) == 2:
        c = min_cosine(probes["off"], probes["on"])
        section["correctness"] = {"min_cosine_on_vs_off": round(c, 6), "ok": c >= MIN_COSINE,
                                  "texts": len(probes["on"])}
    section["summary"] = summarize_variants(section["runs"]) if section["runs"] else None
    return section
