"""From a call's raw inputs to the token-id pieces the engine embeds, and back to one vector each.

Order per input: instruction template (text inputs only) -> tokenize -> token-id checks ->
long-input plan (reject / truncate / chunk) -> pieces. After the engine: chunk vectors merged by
token-weighted mean (re-normalised where the model normalises), then Matryoshka ``dimensions``.
Kept apart from the replica so the replica stays a thin shell around the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common.contracts import InputReport
from ..engine.vllm_engine import EngineInfo
from ..common.errors import InvalidTokenId, UnsupportedParameter
from ..common.long_input import (InputPlan, LongInputPolicy, SpecialTokens, apply_dimensions,
                                 check_dimensions, flatten, merge_planned, plan)
from ..common.prompts import PromptTemplates


@dataclass
class PreparedCall:
    plans: list[InputPlan]
    pieces: list[list[int]]
    input_tokens: int  # what `usage` reports: the (prompted) inputs' tokens, before any chunking

    @property
    def piece_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)

    def report(self) -> tuple[InputReport, ...]:
        return tuple(InputReport(i, p.truncated, p.dropped_tokens, p.chunks, p.input_tokens)
                     for i, p in enumerate(self.plans))


@dataclass
class InputPreparer:
    info: EngineInfo
    tokenizer: Any  # callable(texts) -> list of id lists (the engine's own tokenization)
    special: SpecialTokens
    default_policy: LongInputPolicy
    prompts: PromptTemplates | None = None
    param: str = "input"

    def prepare(self, inputs: list[str] | list[list[int]], *, policy: LongInputPolicy | None,
                prompt_name: str | None, task: str | None,
                dimensions: int | None) -> PreparedCall:
        info = self.info
        if dimensions is not None:
            if not info.supports_dimensions:
                raise UnsupportedParameter(
                    f"model '{info.model}' does not support 'dimensions' (it has no Matryoshka "
                    f"dimensions); it always returns {info.hidden_size}-d vectors",
                    param="dimensions")
            check_dimensions(dimensions, info.hidden_size, info.matryoshka_dimensions,
                             any_up_to_hidden=not info.matryoshka_dimensions, model=info.model)
        if inputs and isinstance(inputs[0], str):
            ids = self.tokenizer(self.prompted(list(inputs), prompt_name, task))  # type: ignore
        else:
            if prompt_name is not None:
                raise UnsupportedParameter("'prompt_name' applies to text inputs, not token ids",
                                           param="prompt_name")
            ids = [list(x) for x in inputs]  # type: ignore[arg-type]
            for i, seq in enumerate(ids):
                bad = next((t for t in seq if t >= info.vocab_size), None)
                if bad is not None:
                    raise InvalidTokenId(
                        f"{self.param}[{i}] holds token id {bad}, outside model "
                        f"'{info.model}''s vocabulary of {info.vocab_size} ids", param=self.param)
        pol = policy or self.default_policy
        plans = [plan(seq, info.max_model_len, pol, self.special, what=f"{self.param}[{i}]",
                      param=self.param) for i, seq in enumerate(ids)]
        return PreparedCall(plans, flatten(plans), sum(len(s) for s in ids))

    def prompted(self, texts: list[str], prompt_name: str | None,
                 task: str | None = None) -> list[str]:
        """Texts with the model's instruction template applied (the named or default one)."""
        if prompt_name is None and not (self.prompts and self.prompts.default_prompt_name):
            return texts
        if self.prompts is None:
            raise UnsupportedParameter(
                f"model '{self.info.model}' has no prompt templates; drop 'prompt_name'",
                param="prompt_name")
        return self.prompts.apply_all(prompt_name, texts, task=task)

    def finish(self, prepared: PreparedCall, vectors: list[np.ndarray], *,
               dimensions: int | None, normalize: bool) -> list[np.ndarray]:
        renorm = normalize and self.info.normalizes
        merged = merge_planned(prepared.plans, vectors, renorm)
        if dimensions is None:
            return merged
        return [apply_dimensions(v, dimensions, self.info.matryoshka_dimensions,
                                 any_up_to_hidden=not self.info.matryoshka_dimensions,
                                 normalize=renorm, model=self.info.model) for v in merged]
