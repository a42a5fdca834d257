"""Start-up checks a replica runs on the ``ascend`` platform before it builds the engine.

A replica on a half-prepared 910B node otherwise dies deep inside torch-npu or vLLM-Ascend with
an error that names neither the cause nor the fix (an ``ImportError`` of a CANN library, a
segfault in ``aclInit``, "device id invalid"). These checks turn the three usual causes into one
message each, saying what to change:

* CANN older than ``MIN_CANN`` (read from the toolkit's ``ascend_toolkit_install.info``);
* torch-npu built for another torch release than the one installed;
* no card visible to this process (``ASCEND_RT_VISIBLE_DEVICES`` unset or empty, or the
  ``/dev/davinci*`` device nodes missing from the container).

The checks are pure functions over an ``AscendEnvironment`` so tests fake every input; ``probe()``
is the only code that reads the real machine. Versions come from ``importlib.metadata`` and files:
torch-npu is never imported here, because importing it on a broken stack is exactly the failure
these checks exist to explain.
"""

from __future__ import annotations

import glob
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .ascend_release import CANN_VERSION
from .vllm_api import distribution_version

# The pinned vllm-ascend release's own requirement (its install guide: CANN == 9.1.0); the seed's
# figure was 8.1.RC1, older than that release needs.
MIN_CANN = CANN_VERSION
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
TOOLKIT_INFO_FILE = "ascend_toolkit_install.info"
# Where set_env.sh points (ASCEND_TOOLKIT_HOME, ASCEND_HOME_PATH), then the default install
# roots: CANN up to 8.3 installs under ascend-toolkit/latest, 8.5 and later under cann/.
TOOLKIT_HOME_ENVS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
DEFAULT_TOOLKIT_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
# The driver's management nodes: without them no card opens, even when /dev/davinciN is there.
MANAGEMENT_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
_CARD_NODE = re.compile(r"^/dev/davinci(\d+)$")


@dataclass(frozen=True)
class AscendEnvironment:
    """Everything the checks look at; ``probe()`` fills it from the real machine."""

    cann_version: str | None
    """The ``version=`` value of the toolkit info file; None when no info file was found."""
    torch_version: str | None
    """Installed torch distribution version (e.g. ``2.5.1``); None when not installed."""
    torch_npu_version: str | None
    """Installed torch-npu distribution version (e.g. ``2.5.1.post1``); None when not installed."""
    visible_devices: str | None
    """``ASCEND_RT_VISIBLE_DEVICES`` as this process sees it; None when unset."""
    device_paths: frozenset[str] = field(default_factory=frozenset)
    """Existing ``/dev/davinci*``, ``/dev/devmm_svm`` and ``/dev/hisi_hdc`` paths."""
    cann_info_path: str | None = None
    """Where ``cann_version`` was read, or the roots searched when nothing was found."""
    toolkit_env: str | None = None
    """``ASCEND_TOOLKIT_HOME`` (or ``ASCEND_HOME_PATH``): set only once ``set_env.sh`` ran."""


@dataclass(frozen=True)
class CheckFailure:
    check: str  # "cann", "torch_npu" or "card": which part of the stack to fix
    message: str  # what is wrong, with the values seen, and what to change

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


class AscendNotReady(RuntimeError):
    """This node cannot run an Ascend replica; the message lists every problem and its fix."""

    def __init__(self, failures: list[CheckFailure]) -> None:
        self.failures = list(failures)
        lines = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(f"Ascend replica cannot start ({len(self.failures)} problem(s)):\n{lines}")


# -- CANN versions ----------------------------------------------------------------------------

# 8.0.RC3, 8.1.RC1, 8.1.0, 8.0.RC2.2 (hot fix), 8.1.RC1.alpha001, 8.5.0.beta1
_CANN_VERSION = re.compile(
    r"^(?P<major>\d+)\.(?P<minor>\d+)\."
    r"(?:RC(?P<rc>\d+)|(?P<patch>\d+))"
    r"(?P<fix>(?:\.\d+)*)"
    r"(?:[.-]?(?P<pre>alpha|beta)(?P<pre_n>\d*))?$",
    re.IGNORECASE,
)


@dataclass(frozen=True, order=True)
class CannVersion:
    """A CANN version ordered the way Huawei releases them.

    Within one major.minor, release candidates come before the final release:
    8.0.RC3 < 8.1.RC1 < 8.1.RC2 < 8.1.0 < 8.1.1. Alpha and beta builds come before the version
    they lead up to (8.1.RC1.alpha001 < 8.1.RC1), so a pre-release of the minimum does not pass.
    """

    major: int
    minor: int
    stage: int  # 0 = release candidate, 1 = final release
    number: int  # the RC number, or the patch number of a final release
    fix: tuple[int, ...]  # hot-fix numbers after the version proper
    pre: tuple[int, int]  # (0, n) alpha, (1, n) beta, (2, 0) none
    text: str = field(compare=False)

    def __str__(self) -> str:
        return self.text


def parse_cann_version(text: str) -> CannVersion:
    """Parse a CANN version string; ``ValueError`` when it is not one."""
    m = _CANN_VERSION.match(text.strip())
    if not m:
        raise ValueError(f"not a CANN version: {text!r}")
    final = m["rc"] is None
    pre = (2, 0)
    if m["pre"]:
        pre = (0 if m["pre"].lower() == "alpha" else 1, int(m["pre_n"] or 0))
    return CannVersion(
        major=int(m["major"]),
        minor=int(m["minor"]),
        stage=1 if final else 0,
        number=int(m["patch"] if final else m["rc"]),
        fix=tuple(int(p) for p in m["fix"].split(".") if p),
        pre=pre,
        text=text.strip(),
    )


def version_from_info(text: str) -> str | None:
    """The ``version=`` value of an ``ascend_toolkit_install.info`` file (not ``innerversion``)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "version":
            return value.strip().strip("\"'") or None
    return None


# -- the checks -------------------------------------------------------------------------------

def check_cann(env: AscendEnvironment, minimum: str = MIN_CANN) -> CheckFailure | None:
    fix = (f"install CANN toolkit {minimum} or newer (with the matching kernels package for "
           "910B) and `source <install root>/set_env.sh` before `ray start`")
    if env.cann_version is None:
        where = env.cann_info_path or "the default install roots"
        return CheckFailure("cann", f"no CANN toolkit found ({TOOLKIT_INFO_FILE} not under "
                                    f"{where}); {fix}")
    try:
        found = parse_cann_version(env.cann_version)
    except ValueError:
        return CheckFailure("cann", f"cannot read CANN version {env.cann_version!r} from "
                                    f"{env.cann_info_path or TOOLKIT_INFO_FILE}; {fix}")
    if found < parse_cann_version(minimum):
        return CheckFailure("cann", f"CANN {found} is older than the required {minimum} "
                                    f"(read from {env.cann_info_path or TOOLKIT_INFO_FILE}); "
                                    f"{fix}")
    if not env.toolkit_env:
        # Installed but not loaded: torch-npu would then fail to find libascendcl.so. Replicas
        # inherit the environment of `ray start`, so that is where set_env.sh must have run.
        return CheckFailure("cann", f"CANN {found} is installed ({env.cann_info_path}) but its "
                                    f"environment is not loaded ({' and '.join(TOOLKIT_HOME_ENVS)} "
                                    "unset in this process); `source <install root>/set_env.sh` "
                                    "before `ray start`, or set its variables in the image")
    return None


_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def _release(text: str) -> tuple[int, int, int] | None:
    """major.minor.micro of a torch-style version; +local, .postN, rcN and .devN dropped."""
    m = _RELEASE.match(text)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def _dotted(release: tuple[int, int, int]) -> str:
    return ".".join(map(str, release))


def check_torch_npu(env: AscendEnvironment) -> CheckFailure | None:
    """torch-npu X.Y.Z[.postN|rcN|.devN] is built against torch X.Y.Z and nothing else."""
    pair_fix = "reinstall a matching pair, e.g. pip install 'embedfleet[ascend]'"
    npu = _release(env.torch_npu_version) if env.torch_npu_version else None
    torch = _release(env.torch_version) if env.torch_version else None
    if env.torch_npu_version is None:
        want = "torch-npu"
        if torch:
            want = (f"the torch-npu release for torch {_dotted(torch)} "
                    f"(torch-npu {_dotted(torch)}[.postN])")
        return CheckFailure("torch_npu", f"torch-npu is not installed; install {want}, e.g. "
                                         "pip install 'embedfleet[ascend]'")
    if env.torch_version is None:
        want = f"torch=={_dotted(npu)}" if npu else "the torch release it was built for"
        return CheckFailure("torch_npu", f"torch is not installed but torch-npu "
                                         f"{env.torch_npu_version} is; install {want}")
    if npu is None or torch is None:
        return CheckFailure("torch_npu", f"cannot compare torch {env.torch_version} with "
                                         f"torch-npu {env.torch_npu_version}; {pair_fix}")
    if npu != torch:
        return CheckFailure(
            "torch_npu",
            f"torch-npu {env.torch_npu_version} is built for torch {_dotted(npu)} but torch "
            f"{env.torch_version} is installed; install torch=={_dotted(npu)}, or the torch-npu "
            f"release for torch {_dotted(torch)}",
        )
    return None


def card_ids(visible: str | None) -> list[int] | None:
    """The card ids in ``ASCEND_RT_VISIBLE_DEVICES``; [] when unset/empty; None when malformed."""
    if visible is None or visible.strip() in ("", "NoDevFiles"):  # Ray's "no devices" marker
        return []
    try:
        return [int(part) for part in visible.split(",")]
    except ValueError:
        return None


def check_card(env: AscendEnvironment) -> CheckFailure | None:
    """The card Ray assigned must exist in this process's view of /dev.

    The ids in ``ASCEND_RT_VISIBLE_DEVICES`` are logical: the runtime numbers the ``davinci``
    nodes a container holds 0..n-1 (a container given only ``/dev/davinci3`` calls it card 0), and
    Ray counts the same nodes to decide how many NPUs a node has. So id k is usable when at least
    k+1 card nodes exist, whatever their physical numbers.
    """
    ray_fix = ("give the replica a card through Ray: ray_actor_options.resources {\"NPU\": 1} on "
               "a node started with NPU resources, and leave "
               "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES unset")
    ids = card_ids(env.visible_devices)
    if ids is None:
        return CheckFailure("card", f"{VISIBLE_DEVICES_ENV}={env.visible_devices!r} is not a "
                                    f"comma-separated list of card ids; {ray_fix}")
    if not ids:
        shown = "unset" if env.visible_devices is None else f"{env.visible_devices!r}"
        return CheckFailure("card", f"no Ascend card visible: {VISIBLE_DEVICES_ENV} is {shown}; "
                                    f"{ray_fix}")
    mount_fix = ("start the container with the cards: docker run --device=/dev/davinciN "
                 + " ".join(f"--device={d}" for d in MANAGEMENT_DEVICES)
                 + ", or on Kubernetes request huawei.com/Ascend910 with the Ascend device plugin "
                 "and Ascend Docker Runtime installed")
    missing = [d for d in MANAGEMENT_DEVICES if d not in env.device_paths]
    cards = sorted(int(m[1]) for p in env.device_paths if (m := _CARD_NODE.match(p)))
    if not cards:
        return CheckFailure("card", f"{VISIBLE_DEVICES_ENV}={env.visible_devices} but no "
                                    f"/dev/davinciN device node exists; {mount_fix}")
    beyond = [i for i in ids if i >= len(cards)]
    if beyond:
        nodes = ", ".join(f"/dev/davinci{c}" for c in cards)
        return CheckFailure("card", f"{VISIBLE_DEVICES_ENV}={env.visible_devices} names card(s) "
                                    f"{beyond} but only {len(cards)} card node(s) exist ({nodes}); "
                                    f"advertise no more NPUs than cards (ray start --resources) "
                                    f"or {mount_fix}")
    if missing:
        return CheckFailure("card", f"driver device node(s) {', '.join(missing)} missing, so no "
                                    f"card can be opened; {mount_fix}")
    return None


def run_checks(env: AscendEnvironment, *, min_cann: str = MIN_CANN) -> list[CheckFailure]:
    """Every failed check, in stack order (toolkit, framework, card); [] when ready."""
    results = [check_cann(env, min_cann), check_torch_npu(env), check_card(env)]
    return [r for r in results if r is not None]


# -- reading the real machine -----------------------------------------------------------------

def find_toolkit_info(environ: Mapping[str, str] | None = None,
                      machine: str | None = None) -> tuple[str | None, str]:
    """(path of the first toolkit info file found, or None; the roots searched, for messages)."""
    environ = os.environ if environ is None else environ
    arch = machine or platform.machine()
    roots = [environ[e] for e in TOOLKIT_HOME_ENVS if environ.get(e)]
    roots += [r for r in DEFAULT_TOOLKIT_ROOTS if r not in roots]
    for root in roots:
        own_arch = Path(root) / f"{arch}-linux" / TOOLKIT_INFO_FILE
        if own_arch.is_file():
            return str(own_arch), ", ".join(roots)
        others = sorted(glob.glob(str(Path(root) / "*-linux" / TOOLKIT_INFO_FILE)))
        if others:
            return others[0], ", ".join(roots)
    return None, ", ".join(roots)


def probe(environ: Mapping[str, str] | None = None, dev_dir: str = "/dev") -> AscendEnvironment:
    """Read this process's Ascend environment: files, distribution metadata, env, /dev."""
    environ = os.environ if environ is None else environ
    info_path, searched = find_toolkit_info(environ)
    cann = None
    if info_path:
        try:
            cann = version_from_info(Path(info_path).read_text(errors="replace"))
        except OSError:
            cann = None
    # Recorded under their /dev names whatever dev_dir is, so tests can probe a fake folder.
    wanted = {Path(d).name for d in MANAGEMENT_DEVICES}
    try:
        names = [n for n in os.listdir(dev_dir) if n.startswith("davinci") or n in wanted]
    except OSError:
        names = []
    devices = {f"/dev/{n}" for n in names}
    return AscendEnvironment(
        cann_version=cann,
        torch_version=distribution_version(("torch",)),
        torch_npu_version=distribution_version(("torch-npu", "torch_npu")),
        visible_devices=environ.get(VISIBLE_DEVICES_ENV),
        device_paths=frozenset(devices),
        cann_info_path=info_path or searched,
        toolkit_env=next((environ[e] for e in TOOLKIT_HOME_ENVS if environ.get(e)), None),
    )


def assert_ascend_ready(env: AscendEnvironment | None = None) -> AscendEnvironment:
    """Raise ``AscendNotReady`` listing every problem; return the environment when ready."""
    env = probe() if env is None else env
    failures = run_checks(env)
    if failures:
        raise AscendNotReady(failures)
    return env
