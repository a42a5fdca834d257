"""One-off check that vLLM serves the tiny Qwen3 as a LAST-pooling embedding model with working
prefix caching. Not collected by pytest (an engine start costs ~50 s on the 2-core dev box).

    HF_HUB_OFFLINE=1 .venv/bin/python -m tests.support.verify_tiny_qwen3_vllm [MODEL_DIR] [--long]

Prints JSON: engine start time, the resolved pooler/cache config, ``num_cached_tokens`` of each
request and the cosines between cold and cache-hit vectors of the same text. ``--long`` also embeds
one 32K-token input.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from embedfleet.benchmarks.tiny_qwen3 import build_tiny_qwen3

ENGINE_ARGS = dict(runner="pooling", dtype="float32", block_size=32,
                   kv_cache_memory_bytes=256 << 20, enforce_eager=True,
                   enable_prefix_caching=True, max_model_len=40960)

# ~420 tokens of shared instruction: well over the 300-token target and > 13 KV blocks of 32.
PREFIX = "Instruct: given a web search query, retrieve relevant passages that answer it. " + " ".join(
    f"rule {i} says the retrieval must prefer precise passages about topic {i}." for i in range(30))


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def main(model_dir: Path, long_input: bool) -> dict:
    from vllm import PoolingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **ENGINE_ARGS))
    report: dict = {"engine_start_s": round(time.monotonic() - t0, 1)}
    mc, cc = engine.vllm_config.model_config, engine.vllm_config.cache_config
    report.update(seq_pooling_type=mc.pooler_config.seq_pooling_type,
                  use_activation=mc.pooler_config.use_activation,
                  attn_type=mc.attn_type, enable_prefix_caching=cc.enable_prefix_caching,
                  is_prefix_caching_supported=mc.is_prefix_caching_supported)
    tokenizer = engine.tokenizer
    counter = iter(range(1_000_000))

    async def embed(text: str) -> tuple[np.ndarray, int, int]:
        final = None
        async for out in engine.encode(text, PoolingParams(task="embed"), f"r{next(counter)}"):
            final = out
        vec = np.asarray(final.outputs.data, dtype=np.float64)
        return vec, final.num_cached_tokens, len(final.prompt_token_ids)

    try:
        x = PREFIX + " Query: how do solar panels work?"
        y = PREFIX + " Query: what is the capital of Peru?"
        report["prefix_tokens"] = len(tokenizer(PREFIX)["input_ids"])
        vx_cold, cx_cold, nx = await embed(x)
        vy_hit, cy_hit, ny = await embed(y)   # shares the prefix with x: hits its blocks
        vx_hit, cx_hit, _ = await embed(x)    # same text again: hits all its full blocks
        await engine.reset_prefix_cache()
        vy_cold, cy_cold, _ = await embed(y)  # the reference for y, computed with nothing cached
        v_suffix, _, _ = await embed("Query: what is the capital of Peru?")
        report.update(
            prompt_tokens={"x": nx, "y": ny},
            num_cached_tokens={"x_cold": cx_cold, "y_shared_prefix": cy_hit, "x_repeat": cx_hit,
                               "y_after_reset": cy_cold},
            cosine_y_hit_vs_cold=_cos(vy_hit, vy_cold),
            cosine_x_hit_vs_cold=_cos(vx_hit, vx_cold),
            max_abs_diff_y=float(np.max(np.abs(vy_hit - vy_cold))),
            # How much the prefix moves the vector: far from 1 means a cache fault would show.
            cosine_y_vs_suffix_alone=_cos(vy_cold, v_suffix),
            norm_y=float(np.linalg.norm(vy_cold)), dim=int(vy_cold.shape[0]),
        )
        if long_input:
            t1 = time.monotonic()
            _, _, n_long = await embed("word " * 32_700)
            report["long_input"] = {"tokens": n_long, "seconds": round(time.monotonic() - t1, 1)}
    finally:
        engine.shutdown()
        del engine  # else AsyncLLM.__del__ shuts down again during interpreter teardown and warns
    return report


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    folder = build_tiny_qwen3(Path(args[0] if args else "/tmp/tiny-qwen3"))
    print(json.dumps(asyncio.run(main(folder, "--long" in sys.argv)), indent=2))
