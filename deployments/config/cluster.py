"""The config's ``cluster`` section: where the 910B cluster runs, for the cluster manifests.

Only ``embedfleet render --kuberay`` / ``--ray-cluster`` (``cluster/manifests.py``) read it, and
the ``render`` flags are checked by its rules (``cluster/manifest_spec.py``); ``embedfleet up``
never does. Kept apart from the rest of the schema (``deployments/config/schema.py``) because its
checks are about container images, host names and Kubernetes labels, not about serving.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ClusterDeployConfig(BaseModel):
    """Where the 910B cluster runs: what ``embedfleet render --kuberay`` / ``--ray-cluster``
    (``cluster/manifests.py``) need beyond the Serve application. The ``render`` flags
    (``--image``, ``--head-address``, ``--worker-address``, ``--node-selector``) override these.
    Nothing here is guessed: a manifest whose image or addresses are not given is refused
    (``render --example`` fills documentation placeholders in instead)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config

    image: Annotated[str, Field(max_length=255)] | None = Field(
        default=None, description="Container image of every Ray node (head and workers, both "
        "renders): CANN, torch-npu, vllm-ascend and ray[serve,data] at the project's pins, with CANN's "
        "set_env.sh variables in its ENV. A reference such as "
        "swr.cn-south-1.myhuaweicloud.com/team/embedfleet-ascend:0.1.0.")
    name: Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=47)] | None = (
        Field(default=None, description="RayService / Ray cluster name; None = app_name. A "
              "DNS-1035 label of at most 47 characters (KubeRay's limit: it appends -xxxxx and "
              "-serve-svc to build service names)."))
    namespace: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                    max_length=63)] | None = Field(
        default=None, description="KubeRay only: the RayService's metadata.namespace; None = "
        "the namespace kubectl applies to.")
    head_address: str | None = Field(
        default=None, description="Launcher only: the head node's IP address or host name "
        "(provider.head_ip), reachable over SSH from where `ray up` runs.")
    worker_addresses: list[str] = Field(
        default_factory=list, description="Launcher only: the worker nodes' IP addresses or host "
        "names (provider.worker_ips); Ray's local provider keeps every one in the cluster.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="KubeRay only: Kubernetes node labels the worker pods "
        "(and, unless head_node_selector says otherwise, the head pod) must match, e.g. "
        "{accelerator: huawei-Ascend910}. Ray's cluster launcher has no selector: its nodes are "
        "worker_addresses.")
    head_node_selector: dict[str, str] | None = Field(
        default=None, description="KubeRay only: node labels for the head pod, which holds no "
        "card; None = node_selector, {} = no selector (the head may run on a node without cards).")
    cards_per_node: Annotated[int, Field(ge=1, le=16)] | None = Field(
        default=None, description="Cards (NPUs) each worker node advertises; None = `cards`. "
        "Sets how many worker nodes the models' replica bounds need.")
    ssh_user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")] = Field(
        default="root", description="Launcher only: the SSH user on every node (auth.ssh_user).")
    ssh_private_key: Annotated[str, Field(min_length=1, pattern=r"^\S+$")] = Field(
        default="~/.ssh/id_rsa", description="Launcher only: the private key `ray up` logs in "
        "with (auth.ssh_private_key), a path on the machine running `ray up`.")

    redis_address: str | None = Field(
        default=None, description="KubeRay only: host:port of an existing Redis the GCS keeps "
        "its tables in (GCS fault tolerance: a new head pod recovers the cluster's state, "
        "embedfleet's durable overrides and limits included). None: the render adds its own "
        "one-pod Redis with its data on a PersistentVolumeClaim. The password always comes "
        "from the Secret <name>-redis.")

    @staticmethod
    def _bad_host(value: str) -> str | None:
        """Why ``value`` is not an IP address or RFC 1123 host name; None when it is one."""
        try:
            ipaddress.ip_address(value)
            return None
        except ValueError:
            pass
        label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        if len(value) <= 253 and re.fullmatch(rf"{label}(\.{label})*", value):
            return None
        return f"{value!r} is not an IP address or host name (no scheme, port or spaces)"

    @staticmethod
    def _bad_label(key: str, value: str) -> str | None:
        """Why ``key: value`` is not a Kubernetes label (key: [prefix/]name); None when it is."""
        name = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
        prefix, _, key_name = key.rpartition("/")
        dns = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
        if not re.fullmatch(name, key_name) or (
                "/" in key and (len(prefix) > 253 or not re.fullmatch(dns, prefix))):
            return (f"{key!r} is not a valid Kubernetes label key: [prefix/]name, the prefix a "
                    "lowercase DNS subdomain, the name at most 63 of A-Z a-z 0-9 - _ . starting "
                    "and ending alphanumeric")
        if value and not re.fullmatch(name, value):
            return (f"{value!r} (for key {key!r}) is not a valid Kubernetes label value: at "
                    "most 63 of A-Z a-z 0-9 - _ . starting and ending alphanumeric, or empty")
        return None

    @staticmethod
    def _bad_image(value: str) -> str | None:
        """Why ``value`` is not a container image reference; None when it is one."""
        component = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
        registry = r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?/"
        tag = r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
        digest = r"@[a-z0-9]+([+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
        if re.fullmatch(rf"({registry})?{component}(/{component})*({tag})?({digest})?", value):
            return None
        return (f"{value!r} is not a container image reference: want "
                "[registry[:port]/]repository[:tag][@digest], repository in lowercase")

    @model_validator(mode="after")
    def _valid_values(self) -> ClusterDeployConfig:
        problems = []
        if self.image is not None and (why := self._bad_image(self.image)):
            problems.append(f"image: {why}")
        if self.head_address is not None and (why := self._bad_host(self.head_address)):
            problems.append(f"head_address: {why}")
        for i, host in enumerate(self.worker_addresses):
            if why := self._bad_host(host):
                problems.append(f"worker_addresses[{i}]: {why}")
        if self.redis_address is not None:
            host, _, port = self.redis_address.rpartition(":")
            why = self._bad_host(host) if host else "no host"
            if why or not port.isdigit() or not 0 < int(port) < 65536:
                problems.append(f"redis_address: {self.redis_address!r} is not host:port")
        repeated = sorted({h for h in self.worker_addresses if self.worker_addresses.count(h) > 1})
        if repeated:
            problems.append(f"worker_addresses: repeated {repeated}")
        if self.head_address and self.head_address in self.worker_addresses:
            problems.append(f"head_address {self.head_address!r} is also in worker_addresses: "
                            "the head runs no engine replica, list it once, as the head")
        for field in ("node_selector", "head_node_selector"):
            for key, value in (getattr(self, field) or {}).items():
                if why := self._bad_label(key, value):
                    problems.append(f"{field}: {why}")
        if problems:
            raise ValueError("; ".join(problems))
        return self
