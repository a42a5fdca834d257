"""Per-model instruction templates, chosen per request by name (TEI's ``prompt_name``).

Instruction-tuned embedders embed queries and documents differently: Qwen3-Embedding wants
``Instruct: {task}\\nQuery:{text}`` for a query and the bare text for a document. The template is
applied to the text before tokenisation, so the instruction tokens are embedded and count in usage
like any other input tokens.

A template holds ``{text}`` (where the input goes) and optionally ``{task}`` (filled from the
request's task or the model's default task); ``{{`` and ``}}`` are literal braces. A template
without ``{text}`` is a plain prefix, which is what sentence-transformers' ``prompts`` are
(``{"query": "query: "}``), so those load unchanged.
Substitution is a single pass over the template, never ``str.format`` on user text: braces in an
input or a task stay literal and cannot inject a placeholder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import UnsupportedParameter

# ``{{`` and ``}}`` are literal braces (as in str.format); ``{name}`` is a placeholder.
_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KNOWN = ("task", "text")

QWEN3_EMBEDDING_DEFAULT_TASK = (
    "Given a web search query, retrieve relevant passages that answer the query")
"""The task Qwen3-Embedding's model card and sentence-transformers config use for queries."""


def _placeholders(template: str) -> list[str]:
    return [m.group(1) for m in _TOKEN.finditer(template) if m.group(1)]


class PromptTemplates(BaseModel):
    """A model's named instruction templates (config), applied by ``apply``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    templates: dict[str, str] = Field(default_factory=dict)
    """Prompt name -> template with ``{text}`` and optionally ``{task}``; no ``{text}`` = prefix."""
    default_task: str | None = None
    """Fills ``{task}`` when the request gives none; required if any template uses ``{task}``."""
    default_prompt_name: str | None = None
    """Template applied when a request names none (sentence-transformers' ``default_prompt_name``);
    None = such requests embed the bare text."""

    @model_validator(mode="after")
    def _check(self) -> PromptTemplates:
        for name, template in self.templates.items():
            fields = _placeholders(template)
            unknown = sorted(set(fields) - set(_KNOWN))
            if unknown:
                raise ValueError(f"prompt template '{name}' has unknown placeholder(s) "
                                 f"{', '.join('{' + u + '}' for u in unknown)}; allowed: "
                                 "{task}, {text}")
            if fields.count("text") > 1:
                raise ValueError(f"prompt template '{name}' holds {{text}} more than once")
            if "task" in fields and not self.default_task:
                raise ValueError(f"prompt template '{name}' uses {{task}} but no default_task "
                                 "is set")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.templates:
            raise ValueError(f"default_prompt_name '{self.default_prompt_name}' is not one of the "
                             f"templates ({self._known()})")
        return self

    @property
    def names(self) -> list[str]:
        return sorted(self.templates)

    def _known(self) -> str:
        return ", ".join(self.names) or "none"

    def apply(self, name: str | None, text: str, task: str | None = None) -> str:
        """``text`` under template ``name`` (None = the default prompt, if any).

        Raises ``UnsupportedParameter`` (400, param ``prompt_name``) for an unknown name, naming
        the known ones.
        """
        if name is None:
            name = self.default_prompt_name
            if name is None:
                return text
        template = self.templates.get(name)
        if template is None:
            raise UnsupportedParameter(
                f"prompt_name '{name}' is not defined for this model; known prompt names: "
                f"{self._known()}", param="prompt_name")
        values = {"task": task or self.default_task or "", "text": text}
        if "text" not in _placeholders(template):
            template += "{text}"
        return _TOKEN.sub(lambda m: values[m.group(1)] if m.group(1) else m.group(0)[0], template)

    def apply_all(self, name: str | None, texts: list[str], task: str | None = None) -> list[str]:
        return [self.apply(name, t, task) for t in texts]

    # -- constructors for known layouts --------------------------------------------------------
    @classmethod
    def qwen3_embedding(cls, default_task: str = QWEN3_EMBEDDING_DEFAULT_TASK) -> PromptTemplates:
        """Qwen3-Embedding: instruction on queries, none on documents (its model card)."""
        return cls(templates={"query": "Instruct: {task}\nQuery:{text}", "document": "{text}"},
                   default_task=default_task)

    @classmethod
    def from_sentence_transformers(cls, model_dir: str | Path) -> PromptTemplates:
        """The ``prompts`` of ``config_sentence_transformers.json`` (prefixes), or no templates."""
        path = Path(model_dir) / "config_sentence_transformers.json"
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        prompts = data.get("prompts") or {}
        # A prefix is literal text: double its braces so none reads as a placeholder.
        templates = {name: prefix.replace("{", "{{").replace("}", "}}") + "{text}"
                     for name, prefix in prompts.items()}
        return cls(templates=templates, default_prompt_name=data.get("default_prompt_name"))
