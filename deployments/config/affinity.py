"""A model's ``routing`` section: how the Router picks one of the model's replicas for a call.

Kept apart from the rest of the schema (``deployments/config/schema.py``) because it is read in two
places only: ``deployments/config/ray_options.py`` renders it into Serve's ``request_router_config``, and the
request router itself (``deployments/ingress/affinity.py``) gets its numbers as kwargs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

RoutingPolicy = Literal["auto", "prefix_affinity", "power_of_two"]


class RoutingConfig(BaseModel):
    """Prefix affinity: calls whose rendered prompts start alike go to the same replica, whose
    prefix cache then already holds their first KV blocks. The key is the request's
    ``prompt_name`` and ``task`` (which fix the instruction template) plus the first input's
    leading characters (or token ids); it is placed on a consistent-hash ring of the model's
    replicas, so a replica joining or leaving moves only its own share of keys. Bounded load: the
    preferred replica is used only while its calls in flight stay within ``load_factor`` x the
    mean; beyond it, and for calls without a key, Serve's power-of-two choice decides."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config

    policy: RoutingPolicy = Field(
        default="auto", description="auto: prefix_affinity unless the model's prefix_cache is "
        "off (a replica that reports its cache off is routed by power-of-two choice either "
        "way); power_of_two: Serve's default router.")
    load_factor: float = Field(
        default=1.5, ge=1.0, le=4.0, description="Bounded load: the preferred replica takes a "
        "call while its calls in flight + 1 <= ceil(load_factor x (all in flight + 1) / "
        "replicas). 1.5: no replica above 1.5x the mean; at 1.25 the bench's 8 in flight over "
        "2 replicas spilled 16% of keyed calls off their replica.")
    min_bound: PositiveInt = Field(
        default=4, le=1024, description="The preferred replica always takes a call while it has "
        "fewer than this many in flight (at low load the mean rounds to 1).")
    prefix_chars: PositiveInt = Field(
        default=256, le=65536, description="Leading characters of the first text in the key "
        "(~4 per token: 256 ~ the first 64 tokens, two KV blocks of 32).")
    prefix_tokens: PositiveInt = Field(
        default=64, le=16384, description="Leading token ids in the key, for token-id inputs.")
    vnodes: PositiveInt = Field(
        default=64, le=1024, description="Points per replica on the hash ring (more: a more "
        "even share of keys per replica).")

    def affinity(self, prefix_cache: str) -> bool:
        """Whether the model's calls are routed by prefix affinity."""
        if self.policy == "auto":
            return prefix_cache != "off"
        return self.policy == "prefix_affinity"

    def router_kwargs(self) -> dict[str, float | int]:
        """What the request router's ``initialize_state`` receives (JSON, as Serve requires)."""
        return self.model_dump(exclude={"policy"})
