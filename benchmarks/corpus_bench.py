"""`embedfleet embed-corpus` against the bench's engine limit on the same texts, alternated:

    embedfleet up --detach --config CFG        # the fleet the job sends to (its engines idle
                                               #   while the bare engine runs, as in the bench)
    python -m embedfleet.benchmarks.corpus_bench --config CFG --repeats 5 --out report.json

Each repeat runs both, order rotated: the job (``embedfleet embed-corpus``, a fresh ``--out``, its
defaults) and the bare engine (``benchmarks.throughput --mode vllm``, the config's first model,
batch 64, 4 in flight). texts/s is each one's own figure (the job: rows over the job's time from
its first block; the engine: texts over the timed embedding, model load excluded). CPU is the
whole machine's busy CPU-seconds over each subprocess's life (the idle cluster included for
both), per 1,000 texts. The corpus is ``tests/test_e2e_corpus.py``'s: 1 to 6 words a text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EMBEDFLEET = str(Path(sys.executable).with_name("embedfleet"))
JOB_RATE = re.compile(r"\(([\d,]+) texts/s\)")


def corpus_text(i: int) -> str:
    return f"passage {i}: " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(1 + i % 6))


def write_corpus(path: Path, rows: int) -> Path:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"doc-{i}", "text": corpus_text(i)}) + "\n")
    return path


def _timed(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    from .process_cpu import machine_busy_s

    busy0, t0 = machine_busy_s(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "RAY_AUTH_MODE": "token"})
    return proc, time.monotonic() - t0, machine_busy_s() - busy0


def run_job(src: Path, model: str, work: Path, rep: int, rows: int) -> dict[str, Any]:
    proc, wall, cpu = _timed([EMBEDFLEET, "embed-corpus", str(src), "--model", model,
                              "--out", str(work / f"out-{rep}")])
    m = JOB_RATE.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"embed-corpus exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"texts_per_s": float(m.group(1).replace(",", "")), "wall_s": round(wall, 1),
            "machine_cpu_s": round(cpu, 1), "cpu_s_per_1k": round(1000 * cpu / rows, 2)}


def run_engine(src: Path, config: str, rows: int) -> dict[str, Any]:
    proc, wall, cpu = _timed([sys.executable, "-m", "embedfleet.benchmarks.throughput",
                              "--mode", "vllm", "--texts-file", str(src), "--batch", "64",
                              "--concurrency", "4", "--config", config])
    if proc.returncode != 0:
        raise RuntimeError(f"throughput exited {proc.returncode}: {proc.stderr[-2000:]}")
    written = Path(proc.stdout.rsplit("written to ", 1)[1].strip())
    (r,) = json.loads(written.read_text())["runs"]
    written.unlink()  # this tool's report holds the run
    return {"texts_per_s": r["texts_per_s"], "wall_s_with_load": round(wall, 1),
            "machine_cpu_s_with_load": round(cpu, 1), "cpu_s_per_1k": round(1000 * cpu / rows, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the config the running cluster was started "
                   "with; the bare engine runs its first model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from ..deployments.config.schema import load_config

    model = load_config(Path(args.config)).models[0].name
    runs: dict[str, list[dict[str, Any]]] = {"corpus": [], "engine": []}
    with tempfile.TemporaryDirectory() as tmp:
        src = write_corpus(Path(tmp) / "corpus.jsonl", args.rows)
        for rep in range(args.repeats):
            order = ["corpus", "engine"] if rep % 2 == 0 else ["engine", "corpus"]
            for peer in order:
                r = (run_job(src, model, Path(tmp), rep, args.rows) if peer == "corpus"
                     else run_engine(src, args.config, args.rows))
                runs[peer].append({"repeat": rep, **r})
                print(f"#{rep} {peer}: {json.dumps(r)}", flush=True)
    med = {peer: {k: statistics.median(r[k] for r in rs) for k in ("texts_per_s", "cpu_s_per_1k")}
           for peer, rs in runs.items()}
    ratio = round(med["corpus"]["texts_per_s"] / med["engine"]["texts_per_s"], 3)
    report = {"config": args.config, "model": model, "rows": args.rows,
              "repeats": args.repeats, "runs": runs, "medians": med,
              "corpus_over_engine": ratio, "goal": 0.85, "goal_met": ratio >= 0.85}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"medians": med, "corpus_over_engine": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
