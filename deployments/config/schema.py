"""The one config schema: served models, platform profile, cards, router options.

Everything else is rendered from an ``EmbedfleetConfig``: the Serve YAML (``cluster/render.py``),
the Ray actor options of each deployment (``deployment_options``), and the vLLM engine arguments of
each replica (``engine_kwargs``). Invalid configs fail at load with a message naming the field and
the value (pydantic's errors carry the field path; our validators put the values in the message).

Sections live in their own modules: where a model's weights come from
(``config/model_source.py``), a model's ``routing`` (``config/affinity.py``), ``admission`` and
``limits`` (``config/admission.py``), ``encodings`` and ``rerank``, the ``router``
(``config/router.py``), the ``governor`` and the ``cluster`` section that only the 910B manifests
read (``config/cluster.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt,
                      PositiveFloat, PositiveInt, ValidationError, field_validator,
                      model_validator)

from .cluster import ClusterDeployConfig
from .router import (RouterConfig, direct_ingress_refusal,
                     uses_direct_ingress)
from .affinity import RoutingConfig
from ..common.contracts import Ceiling
from .model_source import ModelSource
from .rerank import ModelTask, RerankConfig, check_rerank_fields
from .encodings import EncodingsConfig
from .governor import GovernorConfig
from .admission import (CHARS_PER_TOKEN_BOUND, REQUEST_STEPS_BOUND,
                        AdmissionConfig, RequestLimits)
from ..common.long_input import LongInputPolicy
from ..common.prompts import PromptTemplates
from ..engine.prefix_cache_policy import Platform, PrefixCacheSetting  # one definition

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG_PATH = CONFIG_DIR / "local-cpu.yaml"

# vLLM's CPU attention backend only accepts KV blocks in multiples of 32 tokens.
CPU_BLOCK_MULTIPLE = 32
# CPU engines need a fixed KV size (the utilisation knob would refer to host memory).
CPU_DEFAULT_KV_BYTES = 256 << 20
Dtype = Literal["float32", "float16", "bfloat16"]
ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# vLLM 0.23's KV-cache dtypes (``CacheDType`` in vllm/config/cache.py): the engine vllm-ascend
# 0.23.0.post1 runs on, whose platform adds none. vllm-ascend's int8 "C8" KV cache is not one of
# them: a ModelSlim checkpoint selects it (quant_model_description kv_cache_type: C8, read by
# engine.model_facts). tests/test_config_engine.py checks this list against vLLM 0.23's source
# and the installed vLLM.
KvCacheDtype = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                       "fp8_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc",
                       "turboquant_k3v4_nc", "turboquant_3bit_nc", "int8_per_token_head",
                       "fp8_per_token_head", "nvfp4"]


class EngineArgs(_Strict):
    """vLLM engine arguments that matter for pooling models. ``None`` = the platform default."""

    max_num_seqs: PositiveInt = Field(default=128, description="Scheduler's max sequences per step.")
    max_num_batched_tokens: PositiveInt = Field(
        default=16384, description="Scheduler's max tokens per step (fixed at engine start)."
    )
    block_size: PositiveInt | None = Field(default=None, description="KV cache block, tokens.")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="Share of card memory vLLM may plan for (GPU/NPU only)."
    )
    kv_cache_memory_bytes: PositiveInt | None = Field(
        default=None, description="KV cache size in bytes; required on CPU where the "
        "utilisation knob would refer to host memory."
    )
    kv_cache_dtype: KvCacheDtype = Field(
        default="auto", description="KV-cache storage type, one of vLLM's own (auto: the "
        "model's dtype). An int8 KV cache on Ascend comes from a ModelSlim C8 checkpoint, not "
        "from this setting.")

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_cache_dtype(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lower() in ("int8", "c8"):
            raise ValueError(f"kv_cache_dtype {v!r} is not one of vLLM's KV-cache dtypes "
                             f"{list(get_args(KvCacheDtype))}; vllm-ascend's int8 (C8) KV cache "
                             "is chosen by a ModelSlim checkpoint (kv_cache_type: C8)")
        return v
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority", description="vLLM's scheduler order. priority: sequences of the "
        "interactive lane go ahead of bulk ones already waiting inside the engine.")
    enforce_eager: bool = Field(
        default=True, description="Skip graph capture/compilation: faster start, and pooling "
        "batches vary in shape too much to profit much from it on CPU."
    )


class ReplicaBounds(_Strict):
    min_replicas: NonNegativeInt = 1
    max_replicas: PositiveInt = 1
    initial_replicas: NonNegativeInt | None = None
    target_ongoing_requests: PositiveFloat = Field(
        default=8, description="Autoscaling target of requests in flight per replica."
    )
    upscale_delay_s: NonNegativeFloat = Field(
        default=30, description="Load must stay above target this long before a replica is added.")
    downscale_delay_s: NonNegativeFloat = Field(
        default=600, description="Load must stay below target this long before one is removed "
        "(also the idle time before scaling to zero).")
    look_back_period_s: float = Field(
        default=30, gt=10, allow_inf_nan=False, description="Serve averages the requests in "
        "flight over this window for its scaling decisions, so load that stopped keeps counting "
        "this long before downscale_delay_s starts. More than Serve's 10 s metrics interval.")
    cold_start_hold_s: PositiveFloat = Field(
        default=600, description="How long a request is held while the model has no ready "
        "engine: scaled to zero or waiting for a card (min_replicas 0 only, at the router), or "
        "its engine being replaced after a failed canary (at the replica), before 503 + "
        "Retry-After. Covers an engine's cold start, so it is minutes on 910B for an 8B model.")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaBounds:
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                "need min_replicas <= initial_replicas <= max_replicas; got "
                f"min_replicas={self.min_replicas}, initial_replicas={initial}, "
                f"max_replicas={self.max_replicas}"
            )
        return self

    @property
    def fixed(self) -> bool:
        return self.min_replicas == self.max_replicas


class MonitoringConfig(_Strict):
    npu_exporter_targets: list[str] = Field(
        default_factory=list, description="host:port of Ascend npu-exporters to scrape.")
    scrape_interval_s: PositiveInt | None = Field(
        default=None, description="Override of the shipped scrape interval (5 s; Ray exports "
        "replica metrics every 10 s, so a shorter one reads the same values again).")


class ModelConfig(_Strict):
    name: ModelName = Field(description="The `model` field clients send.")
    source: ModelSource
    task: ModelTask = Field(
        default="embed", description="The model's role: embed (vectors; /v1/embeddings, /embed) "
        "or rerank (a cross-encoder or Qwen3-Reranker scoring (query, document) pairs; /rerank, "
        "/v1/rerank, /v2/rerank, /score). Each role answers only its own routes.")
    hf_overrides: dict[str, Any] | None = Field(
        default=None, description="vLLM's hf_overrides for the model's HF config. A known "
        "reranker family (engine/rerank_models.py) gets its own when unset; wrong ones are "
        "refused with the fix.")
    rerank: RerankConfig = RerankConfig()
    dtype: Dtype | None = Field(default=None, description="None = the platform's default dtype.")
    max_model_len: PositiveInt | None = Field(
        default=None, description="Max input tokens; None = what the model's config allows."
    )
    engine: EngineArgs = EngineArgs()
    prefix_cache: PrefixCacheSetting = "auto"
    prefix_cache_accept_risk: bool = Field(
        default=False, description="Let `on` override a known-bad engine/plugin combination."
    )
    canary_interval_s: PositiveFloat = Field(
        default=300, description="Seconds between prefix-cache canary runs (where it is on)."
    )
    replicas: ReplicaBounds = ReplicaBounds()
    routing: RoutingConfig = RoutingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    long_input: LongInputPolicy = Field(
        default_factory=LongInputPolicy,
        description="Default for inputs longer than the model's context; requests may override.")
    prompts: PromptTemplates | None = Field(
        default=None, description="Named instruction templates a request picks by prompt_name.")
    limits: RequestLimits = RequestLimits()
    encodings: EncodingsConfig = Field(
        default_factory=EncodingsConfig, description="Where the int8/uint8 ranges of the "
        "compact encodings come from (ingress/encodings.py).")

    _rerank_fields = model_validator(mode="before")(check_rerank_fields)

    @property
    def max_request_tokens(self) -> int:
        """``limits.max_tokens``, or its default from the card's step budget."""
        return self.limits.max_tokens or REQUEST_STEPS_BOUND * self.engine.max_num_batched_tokens

    @property
    def max_request_chars(self) -> int:
        return self.limits.max_chars or CHARS_PER_TOKEN_BOUND * self.max_request_tokens

    @property
    def large_call_tokens(self) -> int:
        step = self.engine.max_num_batched_tokens  # a reranker's every call is a query with
        # its documents, thousands of tokens: split into small runs it waits for its own runs
        return self.admission.large_call_tokens or (
            step if self.task == "rerank" else max(1, step // 8))

    @property
    def budget_ceiling(self) -> Ceiling:
        return Ceiling(max_sequences=self.admission.max_sequences or self.engine.max_num_seqs,
                       max_tokens=self.admission.max_tokens or self.engine.max_num_batched_tokens)


class PlatformProfile(_Strict):
    """Per-platform defaults. A replica asks Ray for one unit of ``resource`` (one card)."""

    kind: Platform = "cpu"
    resource: str | None = Field(
        default=None, description="Ray resource that counts cards; None = platform default "
        "(NPU on ascend and cpu, GPU on cuda)."
    )
    cpu_card_memory_bytes: PositiveInt = Field(
        default=4 << 30, description="CPU only: capacity of the stand-in card, which holds the "
        "engine's weights, KV pool and activations (deployments/engine/card_memory.py).")
    card_memory_bytes: PositiveInt | None = Field(
        default=None, description="ascend/cuda: device memory of one card (a 910B: 64 GiB). "
        "Used to refuse a config whose memory signal could never fall below the governor's "
        "`high` at idle, and by `embedfleet doctor`; None = unknown (checked at replica start).")

    @property
    def card_resource(self) -> str:
        if self.resource:
            return self.resource
        return "GPU" if self.kind == "cuda" else "NPU"

    @property
    def default_dtype(self) -> Dtype:
        return {"cpu": "float32", "cuda": "float16", "ascend": "bfloat16"}[self.kind]

    @property
    def default_block_size(self) -> int:
        return {"cpu": 32, "cuda": 16, "ascend": 128}[self.kind]


class EmbedfleetConfig(_Strict):
    app_name: ModelName = "embedfleet"
    platform: PlatformProfile = PlatformProfile()
    cards: PositiveInt = Field(default=1, description="Logical cards `embedfleet up` starts with.")
    nodes: PositiveInt = Field(
        default=1, description="Ray nodes `embedfleet up` starts on this machine (a local stand-in "
        "for a multi-node cluster: each node gets cards/nodes cards and its own node name).")
    models: list[ModelConfig] = Field(min_length=1)
    router: RouterConfig = RouterConfig()
    governor: GovernorConfig = GovernorConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    cluster: ClusterDeployConfig | None = Field(
        default=None, description="Where the 910B cluster runs (image, node addresses, node "
        "selectors), for `embedfleet render --kuberay` / `--ray-cluster`; not used by `up`.")
    health_check_period_s: PositiveFloat = 10
    health_check_timeout_s: PositiveFloat = 30
    health_stall_timeout_s: PositiveFloat = Field(
        default=120, description="A replica is reported unhealthy (and Serve replaces it) when "
        "its engine leaves one tiny health probe unanswered this long. A probe slower than "
        "health_check_timeout_s stays pending across checks: on a busy device it waits behind "
        "large batches, and that alone is no reason to kill the replica.")

    @model_validator(mode="after")
    def _cross_checks(self) -> EmbedfleetConfig:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        if self.cards % self.nodes:
            raise ValueError(f"cards={self.cards} cannot be split evenly over nodes={self.nodes}")
        if self.router.proxy_location == "EveryNode" and self._one_machine_haproxy:
            raise ValueError(
                f"router.proxy_location='EveryNode' with nodes={self.nodes} on one machine and "
                "router.http_ingress='haproxy': every node's HAProxy binds router.port and its "
                "stats and metrics ports without SO_REUSEPORT, so all but one crash and restart "
                "every few seconds; use HeadOnly (the default here) or http_ingress: serve_proxy")
        if self.health_stall_timeout_s <= self.health_check_timeout_s:
            raise ValueError(f"health_stall_timeout_s={self.health_stall_timeout_s:g} must be "
                             f"above health_check_timeout_s={self.health_check_timeout_s:g}")
        for i, m in enumerate(self.models):
            block = m.engine.block_size or self.platform.default_block_size
            where = f"models[{i}] ({m.name!r})"
            if self.platform.kind == "cpu":
                if block % CPU_BLOCK_MULTIPLE:
                    raise ValueError(
                        f"{where}: engine.block_size={block} must be a multiple of "
                        f"{CPU_BLOCK_MULTIPLE} on platform 'cpu'"
                    )
                if m.engine.gpu_memory_utilization is not None:
                    raise ValueError(
                        f"{where}: engine.gpu_memory_utilization="
                        f"{m.engine.gpu_memory_utilization} refers to host memory on 'cpu'; "
                        "size the KV cache with engine.kv_cache_memory_bytes instead"
                    )
            if m.engine.max_num_batched_tokens < (m.max_model_len or 0):
                raise ValueError(
                    f"{where}: engine.max_num_batched_tokens={m.engine.max_num_batched_tokens} "
                    f"< max_model_len={m.max_model_len}: a full-length input could never run"
                )
        if self.router.ingress == "engine":
            why = direct_ingress_refusal(self.router, self.models)
            if why:
                raise ValueError(f"router.ingress='engine' but {why}")
        return self

    @property
    def direct_ingress(self) -> bool:
        """Whether the engine replicas take HTTP themselves (``router.ingress``, resolved)."""
        return uses_direct_ingress(self.router, self.models)

    @property
    def _one_machine_haproxy(self) -> bool:
        return self.nodes > 1 and self.router.http_ingress == "haproxy"

    @property
    def proxy_location(self) -> Literal["EveryNode", "HeadOnly"]:
        """Serve's: as set, else EveryNode but HeadOnly for HAProxy on one machine's nodes."""
        if self.router.proxy_location:
            return self.router.proxy_location
        return "HeadOnly" if self._one_machine_haproxy else "EveryNode"

    # -- rendering helpers: the single function from config to engine args -------------------
    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def engine_kwargs(self, m: ModelConfig, *, enable_prefix_caching: bool) -> dict[str, Any]:
        """``vllm.AsyncEngineArgs`` keyword arguments for one replica of model ``m``."""
        kw: dict[str, Any] = {
            "model": m.source.resolve(),
            "runner": "pooling",
            "dtype": m.dtype or self.platform.default_dtype,
            "block_size": m.engine.block_size or self.platform.default_block_size,
            "max_num_seqs": m.engine.max_num_seqs,
            "max_num_batched_tokens": m.engine.max_num_batched_tokens,
            "enforce_eager": m.engine.enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "kv_cache_dtype": m.engine.kv_cache_dtype,
            "scheduling_policy": m.engine.scheduling_policy,
            "served_model_name": m.name,
        }
        if m.max_model_len:
            kw["max_model_len"] = m.max_model_len
        if m.hf_overrides:
            kw["hf_overrides"] = dict(m.hf_overrides)
        if m.engine.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = m.engine.gpu_memory_utilization
        if self.platform.kind == "cpu":
            # vLLM's worker inside its engine-core process, as vLLM runs one card's worker on NPU
            # and GPU. vLLM's CPU platform otherwise starts it as a process of its own, fed
            # through a shared-memory queue whose reader spins on sched_yield for a second
            # after each read: a third process busy on a 2-core machine. Bare AsyncLLM, one text
            # per call, 16 in flight, MiniLM here: 254 vs 152 texts/s, 7.8 vs 13.1 CPU-s per
            # 1,000 texts (medians of 5 alternating pairs). vllm_api.start_engine sets what the
            # CPU platform checks before it keeps this.
            kw["distributed_executor_backend"] = "uni"
        pool = self.engine_kwargs_pool_bytes(m)
        if pool is not None:
            kw["kv_cache_memory_bytes"] = pool
        return kw

    def engine_kwargs_pool_bytes(self, m: ModelConfig) -> int | None:
        """The KV pool's size when the config fixes it (always on CPU); None = vLLM sizes it
        from ``gpu_memory_utilization``."""
        if m.engine.kv_cache_memory_bytes is not None:
            return m.engine.kv_cache_memory_bytes
        return CPU_DEFAULT_KV_BYTES if self.platform.kind == "cpu" else None


class ConfigError(Exception):
    """A config file that cannot be used; the message names the field and the value."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid embedfleet config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {loc}: {e['msg']} (got {shown[:200]})")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<dict>") -> EmbedfleetConfig:
    try:
        return EmbedfleetConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path | None = None) -> EmbedfleetConfig:
    """Load a YAML config; ``None`` = the bundled local CPU default.

    Beyond the schema, a config whose memory signal could never fall below the governor's
    ``high`` at idle is refused here (``signal_floor_problems``): it needs the models' weights,
    so it runs where configs are loaded from files (the CLI), not in every replica."""
    p = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {p} is not valid YAML: {err}") from None
    cfg = parse_config(data, str(p))
    from ..engine.card_memory import signal_floor_problems

    problems = signal_floor_problems(cfg)
    if problems:
        raise ConfigError(f"invalid embedfleet config {p}:\n" + "\n".join(
            f"  {x}" for x in problems))
    return cfg


def config_to_data(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """Plain data that ``parse_config`` turns back into an equal config (defaults omitted)."""
    return cfg.model_dump(mode="json", exclude_defaults=True)
