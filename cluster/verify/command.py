"""`embedfleet verify`: are a running cluster's vectors right?

Per model, on a fixed built-in corpus (short, long, unicode, code):
  reference          served vectors vs transformers running the same weights with the model's
                     pooling (MEAN over the attention mask / CLS / LAST token) and L2 normalisation
                     where the model normalises: cosine per text, min and mean.
  batch invariance   each text embedded alone vs inside a shuffled batch of the others: a vector
                     must not depend on what else the engine batched with it.
  cache hit vs cold  (models serving with prefix caching on) texts sharing a 300+ token prefix,
                     embedded cold and again from the cache: the hit must be reported
                     (usage.prompt_tokens_details.cached_tokens > 0) and the vectors must agree.
  golden             (--golden FILE) vs vectors saved by --save-golden, e.g. on another platform or
                     release; a differing fingerprint (x-embedfleet-* headers) is called out.

Exit code: 0 every check passed or was skipped (the table says why), 1 a check failed, 2 the
command could not run (bad arguments, cluster unreachable, unknown model, unreadable golden file).
Nothing is downloaded: the reference loads local folders only (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The command lives here; the checks, client, reference and golden files in the verify_* modules.
# Their names are re-exported because tests and users import them from embedfleet.cluster.verify.command.
from .checks import (BATCH, CACHE, CACHE_PREFIX_MIN_TOKENS, CACHE_SIBLING,
          CACHE_SUFFIXES, CORPUS, EXACT_COSINE, GOLDEN, HIT_ATTEMPTS,
          NORM_TOLERANCE, REFERENCE, SHARED_PREFIX, SHUFFLE_SEED,
          CheckResult, ModelReport, Status, check_batch, check_cache,
          check_golden, check_reference, cosines, judge, verify_model)
from .client import (FINGERPRINT_KEYS, Embedded, EmbeddingsClient, HttpClient,
          ServerError, VerifyUsageError)
from .golden import (GOLDEN_FORMAT, GoldenEntry, fingerprint_diff, load_golden,
          save_golden)
from .reference import (BUNDLED_PACKAGES, REFERENCE_BATCH, PoolingSpec,
             Reference, bundled_path, pool, pooling_spec)

__all__ = [
    # this module: the command
    "DEFAULT_URL", "DEFAULT_MIN_COSINE", "render", "configure", "add_parser", "run", "main",
    # embedfleet.cluster.verify.checks
    "REFERENCE", "BATCH", "CACHE", "GOLDEN", "Status", "EXACT_COSINE", "CACHE_PREFIX_MIN_TOKENS",
    "NORM_TOLERANCE", "HIT_ATTEMPTS", "SHUFFLE_SEED", "CORPUS", "SHARED_PREFIX", "CACHE_SUFFIXES",
    "CACHE_SIBLING", "CheckResult", "cosines", "judge", "check_reference", "check_batch",
    "check_cache", "check_golden", "ModelReport", "verify_model",
    # embedfleet.cluster.verify.client
    "FINGERPRINT_KEYS", "VerifyUsageError", "ServerError", "Embedded", "EmbeddingsClient",
    "HttpClient",
    # embedfleet.cluster.verify.golden
    "GOLDEN_FORMAT", "GoldenEntry", "save_golden", "load_golden", "fingerprint_diff",
    # embedfleet.cluster.verify.reference
    "REFERENCE_BATCH", "BUNDLED_PACKAGES", "PoolingSpec", "pooling_spec", "pool", "Reference",
    "bundled_path",
]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MIN_COSINE = 0.999


# -- output --------------------------------------------------------------------------------------
_STYLE = {"PASS": "bold green", "FAIL": "bold red", "SKIP": "yellow"}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def _snippet(text: str, n: int = 48) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[:n - 1] + "…"


def render(reports: Sequence[ModelReport], console: Any) -> None:
    from rich.table import Table

    for rep in reports:
        verdict = "PASS" if rep.passed else "FAIL"
        caption = ", ".join(f"{k.removeprefix('x-embedfleet-')}={v}"
                            for k, v in rep.fingerprint.items())
        table = Table(title=f"{rep.model}: [{_STYLE[verdict]}]{verdict}[/]", title_justify="left",
                      caption=caption or None, caption_justify="left")
        for col in ("check", "texts", "min cosine", "mean cosine", "threshold", "result"):
            table.add_column(col, justify="left" if col in ("check", "result") else "right")
        table.add_column("note", overflow="fold")
        for c in rep.checks:
            table.add_row(c.name, str(len(c.cosines)) if c.cosines else "-", _fmt(c.min),
                          _fmt(c.mean), _fmt(c.threshold), f"[{_STYLE[c.status]}]{c.status}[/]",
                          c.note)
        console.print(table)
        for c in rep.checks:
            low = c.below()
            if c.status == "FAIL" and low:
                console.print(f"  {c.name} FAIL, worst texts:")
                for text, cos in sorted(low, key=lambda x: x[1])[:8]:
                    console.print(f"    {cos:>9.6f}  {_snippet(text)!r}", markup=False)
    failed = [r.model for r in reports if not r.passed]
    console.print(f"[bold red]FAIL[/]: {', '.join(failed)}" if failed else
                  f"[bold green]PASS[/]: {len(reports)} model(s) verified")


# -- command -------------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", default=DEFAULT_URL,
                   help="the cluster's endpoint (default: %(default)s)")
    p.add_argument("--model", action="append", dest="models", metavar="NAME",
                   help="model to verify; repeatable (default: every model /v1/models lists)")
    p.add_argument("--model-path", action="append", default=[], metavar="NAME=PATH",
                   help="local folder of a model's weights for the reference check (the bundled "
                   f"{', '.join(BUNDLED_PACKAGES)} is found on its own)")
    p.add_argument("--golden", type=Path, metavar="FILE", help="compare with saved vectors "
                   "(.json or .npz written by --save-golden)")
    p.add_argument("--save-golden", type=Path, metavar="FILE",
                   help="save the corpus vectors and fingerprints (.json, or .npz)")
    p.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE,
                   help="threshold of the reference and golden checks (default: %(default)s)")
    p.add_argument("--api-key", help="bearer key, if the router needs one (default: "
                   "$EMBEDFLEET_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return configure(subparsers.add_parser(
        "verify", help="check a running cluster's vectors (reference, batch, cache, golden)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def _model_paths(specs: Sequence[str]) -> dict[str, Path]:
    paths = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise VerifyUsageError(f"--model-path {spec!r}: expected NAME=PATH")
        if not (Path(path) / "config.json").is_file():
            raise VerifyUsageError(f"--model-path {spec!r}: {path} holds no config.json")
        paths[name] = Path(path)
    return paths


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    status = Console(stderr=True)
    try:
        if not 0 < args.min_cosine <= 1:
            raise VerifyUsageError(f"--min-cosine {args.min_cosine}: must be in (0, 1]")
        paths = _model_paths(args.model_path)
        golden = load_golden(args.golden) if args.golden else None
        client = HttpClient(args.url, args.api_key or os.environ.get("EMBEDFLEET_API_KEY"))
        served = {m["id"]: m for m in client.models()}
        names = args.models or list(served)
        unknown = [n for n in [*names, *paths] if n not in served]
        if unknown:
            raise VerifyUsageError(f"not served at {args.url}: {', '.join(unknown)} "
                                   f"(served: {', '.join(served)})")
        reports, saved = [], {}
        for name in names:
            with status.status(f"verifying {name}…"):
                rep, entry = verify_model(client, served[name],
                                          paths.get(name) or bundled_path(name), golden,
                                          args.min_cosine)
            reports.append(rep)
            if entry is not None:
                saved[name] = entry
        if args.save_golden:
            save_golden(args.save_golden, saved, args.url)
    except VerifyUsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    passed = all(r.passed for r in reports)
    if args.json:
        print(json.dumps({"url": args.url, "passed": passed,
                          "models": [r.as_dict() for r in reports]}, indent=2, ensure_ascii=False))
    else:
        render(reports, console)
        if args.save_golden:
            console.print(f"golden vectors saved to {args.save_golden}")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embedfleet verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(configure(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
