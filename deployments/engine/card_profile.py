"""A card profile: what one model's engine takes of one card, measured or stated as an assumption.

The governor's pressure is memory *outside* the KV pool against what the pool leaves
(``card_memory.live_pressure``). Where that ratio should sit at idle and at the planned operating
point, and how much headroom the worst step the config allows leaves before the card runs out, are
facts of the card, the engine and the model, not of the control law. ``embedfleet calibrate``
measures them on the card (the engine started, the worst step run) and writes this file; the
governor reads it at start and ``benchmarks/governor_sim.py`` simulates the card it describes.

A profile is ``source: measured`` (every number read from a runtime) or ``source: assumption``
(numbers taken from documentation, upstream code or arithmetic): an assumption must say, in
``notes``, where each of its numbers comes from, so it is never mistaken for a measurement.

Where profiles live: ``default_profile_path`` (one per app and model under the state directory,
where ``calibrate`` writes); assumption profiles ship with the package under
``deployments/configs/profiles/`` (``shipped_profile_path``).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt,
                      model_validator)

from .card_memory import AllocatorCounters  # one definition
from ..common.settings import settings

__all__ = ["AllocatorCounters", "CardProfile", "WorstStep", "default_profile_path",
           "load_profile", "resolve_profile", "save_profile", "shipped_profile_path"]

PROFILE_DIR = Path(__file__).resolve().parent.parent / "configs" / "profiles"
SCHEMA_VERSION = 1

# The numbers a profile states; an assumption profile must name a source for each in ``notes``.
NUMBERS = ("card_total_bytes", "kv_pool_bytes", "weights_bytes", "idle_outside_pool_bytes",
           "worst_step_peak_bytes", "headroom_bytes", "safety_margin_bytes", "allocator",
           "worst_step")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorstStep(_Strict):
    """The step ``calibrate`` ran as the worst the config allows (every sequence full length)."""

    sequences: PositiveInt = Field(description="Sequences in the step (max_num_seqs bounded by "
                                               "max_num_batched_tokens / max_model_len).")
    tokens: PositiveInt = Field(description="Tokens in the step (up to max_num_batched_tokens).")
    tokens_per_sequence: PositiveInt = Field(description="Each sequence's length (max_model_len).")


class CardProfile(_Strict):
    """One model's engine on one card. Bytes are device bytes as the runtime counts them."""

    schema_version: Literal[1] = SCHEMA_VERSION
    source: Literal["measured", "assumption"] = Field(
        description="measured: read on a card by `embedfleet calibrate`; assumption: stated "
                    "from documentation or upstream code, each number's origin in `notes`.")
    platform: Literal["ascend", "cuda", "cpu"] = Field(description="The card's platform kind.")
    app_name: str = Field(description="The config's app_name the profile was measured for.")
    model: str = Field(description="The served model's name (the `model` clients send).")
    model_source: str = Field(description="Where its weights came from (path or hub id).")
    engine_version: str | None = Field(description="vLLM's version (package metadata).")
    plugin_version: str | None = Field(
        description="The platform plugin's version (vllm-ascend), None where there is none.")
    measured_at: datetime = Field(
        description="When the numbers were taken (for an assumption: when they were written).")
    card_total_bytes: PositiveInt = Field(
        description="The card's memory as the runtime reports it (mem_get_info's total), not "
                    "the marketing size: the denominator every ratio starts from.")
    kv_pool_bytes: NonNegativeInt = Field(
        description="The KV-cache pool the engine preallocated at start (fixed for its life).")
    weights_bytes: NonNegativeInt = Field(description="The model's weights on the card.")
    idle_outside_pool_bytes: NonNegativeInt = Field(
        description="Device memory held outside the KV pool with the engine started and idle "
                    "(weights and runtime; bytes the allocator caches but no tensor holds are "
                    "not counted, as in card_memory's pressure).")
    worst_step_peak_bytes: NonNegativeInt = Field(
        description="Peak device memory held outside the KV pool during the worst step: "
                    "weights, runtime, activations and attention workspace.")
    headroom_bytes: int = Field(
        description="What the worst step left of the card: card total - KV pool - worst-step "
                    "peak. Negative if it did not fit.")
    safety_margin_bytes: NonNegativeInt = Field(
        description="The headroom the worst step must leave for the profile to be accepted: "
                    "room for what calibration cannot reproduce (fragmentation over hours, "
                    "runtime growth).")
    allocator: AllocatorCounters = Field(
        description="The allocator's retry and OOM counters over the worst step.")
    worst_step: WorstStep = Field(description="The step that was run (or assumed) as the worst.")
    gpu_memory_utilization: float | None = Field(
        default=None, description="The engine's setting the pool was sized with, if any.")
    notes: dict[str, str] = Field(
        default_factory=dict,
        description="Where each number comes from (field name -> origin); required for every "
                    "number of an assumption profile.")

    @model_validator(mode="after")
    def _consistent(self) -> CardProfile:
        left = self.card_total_bytes - self.kv_pool_bytes - self.worst_step_peak_bytes
        if self.headroom_bytes != left:
            raise ValueError(
                f"headroom_bytes={self.headroom_bytes} is not card_total_bytes - kv_pool_bytes - "
                f"worst_step_peak_bytes = {self.card_total_bytes} - {self.kv_pool_bytes} - "
                f"{self.worst_step_peak_bytes} = {left}")
        if self.kv_pool_bytes >= self.card_total_bytes:
            raise ValueError(f"kv_pool_bytes={self.kv_pool_bytes} leaves nothing of "
                             f"card_total_bytes={self.card_total_bytes}")
        if self.idle_outside_pool_bytes < self.weights_bytes:
            raise ValueError(f"idle_outside_pool_bytes={self.idle_outside_pool_bytes} is below "
                             f"weights_bytes={self.weights_bytes}: the weights are outside the pool")
        if self.worst_step_peak_bytes < self.idle_outside_pool_bytes:
            raise ValueError(f"worst_step_peak_bytes={self.worst_step_peak_bytes} is below "
                             f"idle_outside_pool_bytes={self.idle_outside_pool_bytes}")
        if self.source == "assumption":
            missing = [n for n in NUMBERS if not self.notes.get(n)]
            if missing:
                raise ValueError(f"an assumption profile must say where each number comes "
                                 f"from: notes lacks {missing}")
        return self

    @property
    def outside_capacity_bytes(self) -> int:
        """What the pool leaves for everything else: the pressure ratio's denominator."""
        return self.card_total_bytes - self.kv_pool_bytes

    def pressure(self, outside_bytes: int) -> float:
        """The governor's ratio for this many bytes in use outside the pool."""
        return outside_bytes / self.outside_capacity_bytes

    @property
    def idle_ratio(self) -> float:
        return self.pressure(self.idle_outside_pool_bytes)

    @property
    def operating_point_ratio(self) -> float:
        """The ratio at the planned operating point: the worst step the config allows."""
        return self.pressure(self.worst_step_peak_bytes)

    @property
    def safe_ratio(self) -> float:
        """The ratio at which only the safety margin is left: above it the card is past its plan."""
        return self.pressure(self.outside_capacity_bytes - self.safety_margin_bytes)

    @property
    def fits(self) -> bool:
        """The worst step left at least the safety margin and the allocator never failed."""
        return (self.headroom_bytes >= self.safety_margin_bytes
                and self.allocator.num_ooms == 0)


def default_profile_path(app_name: str, model: str, state_dir: Path | None = None) -> Path:
    """Where ``calibrate`` writes and the governor looks: one file per app and model."""
    base = state_dir if state_dir is not None else settings().state_dir
    return base / "profiles" / f"{app_name}--{model}.json"


def shipped_profile_path(name: str) -> Path:
    """A profile shipped with the package (``deployments/configs/profiles/<name>.json``)."""
    return PROFILE_DIR / f"{name}.json"


def load_profile(path: str | Path) -> CardProfile:
    """Read and validate a profile; a bad file raises ``ValueError`` naming the file."""
    p = Path(path).expanduser()
    try:
        return CardProfile.model_validate_json(p.read_bytes())
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"card profile {p}: {e}") from e


def save_profile(profile: CardProfile, path: str | Path) -> Path:
    """Write atomically (temp file + rename), so a reader never sees half a profile."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(profile.model_dump(mode="json"), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def resolve_profile(app_name: str, model: str, platform: str,
                    named: str | None = None) -> tuple[CardProfile, Path] | None:
    """The profile for ``model``: ``named`` (a path, or a shipped profile's name), else the one
    ``calibrate`` wrote for this app and model, else None. Raises ``ValueError`` for a profile
    that cannot be read or describes another model or platform."""
    if named is None:
        path = default_profile_path(app_name, model)
        if not path.exists():
            return None
    else:
        path = Path(named).expanduser()
        if not path.exists() and "/" not in named:
            path = shipped_profile_path(named)
    try:
        profile = load_profile(path)
    except OSError as e:
        raise ValueError(f"cannot read card profile {path}: {e}") from e
    if profile.model != model or profile.platform != platform:
        raise ValueError(f"card profile {path} is for {profile.model} on {profile.platform}, "
                         f"not {model} on {platform}")
    return profile, path
