"""Which card a replica holds, and per-platform process set-up before the engine starts.

Ray gives each replica one unit of the card resource and sets ``ASCEND_RT_VISIBLE_DEVICES``
(``NPU``) or ``CUDA_VISIBLE_DEVICES`` (``GPU``). On CPU the same logical ``NPU`` resource is used, so
the one-replica-per-card rule is exercised; there the "card" is a slice of the node's cores.
Nothing here imports torch-npu or vllm-ascend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VISIBLE_DEVICES_ENV = {"NPU": "ASCEND_RT_VISIBLE_DEVICES", "GPU": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class CardIdentity:
    """Which card a replica holds: ``(node, device)``.

    ``node`` is the node's Ray name (``ray start --node-name``), which defaults to the node IP, so
    on a real cluster it is the IP that exporters' scrape configs attach. Local multi-node
    clusters (``nodes > 1``) run every node on one IP and tell them apart by name."""

    node_id: str
    node: str
    node_ip: str
    device: str  # the card id(s) Ray assigned, as in the visible-devices variable
    cards_on_node: int = 1  # the node's total of the card resource (CPU cards split its cores)

    @property
    def label(self) -> str:
        return f"{self.node}/{self.device}"


def card_identity(resource: str) -> CardIdentity:
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids().get(resource) or []
    device = ",".join(str(i) for i in ids) or os.environ.get(VISIBLE_DEVICES_ENV.get(resource, ""), "")
    node_id = ctx.get_node_id()
    ip = ray.util.get_node_ip_address()
    node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), {})
    return CardIdentity(node_id=node_id, node=node.get("NodeName") or ip, node_ip=ip,
                        device=device or "none",
                        cards_on_node=int(node.get("Resources", {}).get(resource, 1)))


def cpu_cores_for_card(device: str, cards_on_node: int, cores: list[int]) -> list[int]:
    """The cores a CPU "card" gets: an even slice of the node's cores, or one shared core.

    vLLM's CPU backend binds its OpenMP threads; left on ``auto`` every replica on a node binds
    the same cores and they fight. Splitting by card id gives each replica its own.
    """
    try:
        card = int(device.split(",")[0])
    except ValueError:
        return cores
    cards = max(1, cards_on_node)
    if len(cores) >= cards:
        per = len(cores) // cards
        return cores[(card % cards) * per:(card % cards + 1) * per]
    return [cores[card % len(cores)]]


def prepare_cpu_process(device: str, cards_on_node: int) -> str:
    """Set vLLM CPU thread binding for this replica's card; returns the binding used."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # an operator's explicit choice wins
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cores = sorted(os.sched_getaffinity(0))
    mine = cpu_cores_for_card(device, cards_on_node, cores)
    binding = ",".join(str(c) for c in mine)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return binding


def platform_facts(kind: str):
    """Engine and plugin versions for the prefix-cache policy, read without side effects.

    vllm-ascend is only imported on the ``ascend`` platform (never on a machine without an NPU).
    """
    import vllm

    from deployments.prefix_cache_policy import PlatformFacts

    plugin = None
    if kind == "ascend":
        try:
            import vllm_ascend  # type: ignore[import-not-found]

            plugin = getattr(vllm_ascend, "__version__", None)
        except ImportError:
            plugin = None
    return PlatformFacts(platform=kind, vllm_version=vllm.__version__, vllm_ascend_version=plugin)
