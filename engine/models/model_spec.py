"""What `--model` and its per-model options ask for, before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pooling_server.engine.backends import BackendOptions
from pooling_server.engine.models.model_info import LongInput, PoolingType

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class ModelSpec:
    """One `--model` and its per-model options."""

    source: str
    name: str | None = None
    pooling_type: PoolingType | None = None
    truncation_side: str = "right"
    long_input: LongInput = LongInput.REJECT
    max_input_chars: int | None = None  # None: derived from the maximum tokens
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # None: the folder's sentence-transformers default; "": no default prompt.
    default_prompt_name: str | None = None
    revision: str | None = None  # a hub branch, tag or commit (None: the default branch)
    trust_remote_code: bool = False  # run modeling code shipped with the model
    # --score-template (a file, or the template inline) and --score-tokens ("yes,no"): serve
    # a decoder LM as an LLM reranker (its family reads the template); None: the folder's
    # own.
    score_template: str | None = None
    score_tokens: str | None = None
    # --label-template: an image model's zero-shot prompt ("{label}" replaced); None: the
    # default, "a photo of a {label}."
    label_template: str | None = None
    # --backend, --backend-file, --quantize, --calibration-file
    backend: BackendOptions = field(default_factory=BackendOptions)
    # --adapter NAME=PATH after this --model: PEFT LoRA adapters served beside its base
    # weights (engine/models/adapters.py), as (name, path) in the order given.
    adapters: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, value: str, **options: Any) -> ModelSpec:
        """`PATH_OR_ID` or `NAME=PATH_OR_ID`."""
        name, sep, source = value.partition("=")
        if sep and name and source:
            return cls(source=source, name=name, **options)
        return cls(source=value, **options)

    @property
    def served_name(self) -> str:
        return self.name or self.source
