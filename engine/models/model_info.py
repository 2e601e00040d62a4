"""What a loaded model can do: the facts validation and ListModels rely on."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec

from pooling_server.engine.requests.params import Task


class PoolingType(StrEnum):
    """How token states become one vector (the pooling *method*, separate from heads)."""

    MEAN = "mean"
    CLS = "cls"
    LAST = "last"
    ALL = "all"
    SPLADE = "splade"  # max over tokens of log(1 + relu(MLM logits))


class HeadKind(StrEnum):
    """What the loaded transformers module returns."""

    HIDDEN = "hidden"  # AutoModel: token states; embed, token_embed, score by cosine
    SEQUENCE = "sequence"  # AutoModelForSequenceClassification: one logit row per text
    # AutoModelForTokenClassification, or a masked LM (SPLADE): one logit row per token
    TOKEN = "token"
    # Two towers, each its own input into one shared space (get_text_features, and the
    # image or audio tower's): one projected vector per input, no token states.
    TOWERS = "towers"


class Activation(StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    IDENTITY = "identity"


class LongInput(StrEnum):
    REJECT = "reject"
    CHUNK = "chunk"
    TRUNCATE = "truncate"


# The tasks a plain head serves; a family whose module is its own (SPLADE, two towers, an
# LLM reranker) states its tasks as it loads.
TASKS_BY_HEAD: dict[HeadKind, tuple[Task, ...]] = {
    HeadKind.HIDDEN: (Task.EMBED, Task.TOKEN_EMBED, Task.SCORE),
    HeadKind.SEQUENCE: (Task.CLASSIFY,),
    HeadKind.TOKEN: (Task.TOKEN_CLASSIFY,),
}


# Characters per token of the maximum length allowed in one text: English averages about
# four, so these leave room for any real text while bounding what one text can cost.
CHARS_PER_TOKEN = 64
LONG_CHARS_PER_TOKEN = 1024


@dataclass(frozen=True)
class ModelInfo:
    name: str
    # The family that loaded it (engine/families: "encoder", "cross_encoder", ...): whose
    # rules and plan its requests go through.
    family: str
    architecture: str
    head: HeadKind
    tasks: tuple[Task, ...]
    hidden_size: int
    max_input_tokens: int
    num_special_tokens: int
    pooling_type: PoolingType
    default_normalize: bool
    activation: Activation
    labels: tuple[str, ...] = ()
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    truncation_side: str = "right"
    long_input: LongInput = LongInput.REJECT
    max_input_chars: int | None = None  # None: derived, see char_limit
    is_default: bool = False
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text prepended
    default_prompt_name: str | None = None
    # Whether prompt tokens count in the pooling (sentence-transformers' include_prompt).
    include_prompt: bool = True
    dtype: str = ""
    device: str = ""
    revision: str = ""
    # int8/uint8 encodings: per-dimension [minimums, maximums].
    calibration_ranges: list[list[float]] | None = None
    # Where they came from: "folder" (shipped with the model), "computed" (from the
    # calibration texts at load, engine/models/calibration.py), or "" when the model has none.
    calibration_source: str = ""
    # What runs the transformer's forward (engine/backends): torch, onnx or openvino; its
    # precision (float32, int8, or torch's dtype) and the export file ("" for torch).
    backend: str = "torch"
    precision: str = ""
    backend_file: str = ""
    engines_per_device: int = 1  # engine processes serving it on each device
    # The LoRA adapters loaded with it (--adapter), which every front end routes to by
    # name (Engine.adapters); those loaded at run time are routed as they load.
    adapters: tuple[str, ...] = ()
    # Dense modules project the pooled vector (sentence-transformers' Dense): a late
    # chunk's mean must be whole before it is projected (engine/requests/late_chunking.py).
    projected: bool = False
    # What inputs the model accepts (engine/inputs/modality.py's values).
    modalities: tuple[str, ...] = ("text",)
    # The family's own facts (a frozen dataclass of its package: an LLM reranker's
    # ScoreTemplate, SPLADE's pooling, ...), or None. JSON carries them to a front-end
    # process as plain values, typed again here (Family.settings).
    settings: Any = None

    def __post_init__(self) -> None:
        if type(self.settings) is dict:  # decoded from an engine process's description
            from pooling_server.engine.families import family

            typed = msgspec.convert(self.settings, family(self.family).settings)
            object.__setattr__(self, "settings", typed)

    @property
    def accepts_images(self) -> bool:
        return "image" in self.modalities

    @property
    def accepts_media(self) -> bool:
        """Whether it takes inputs other than texts (images, audio clips)."""
        return len(self.modalities) > 1

    @property
    def is_cross_encoder(self) -> bool:
        """Scores each pair in one pass (a classifier head, or an LLM reranker's template),
        rather than by the cosine of two embeddings: one row per pair."""
        return Task.SCORE in self.tasks and self.head is HeadKind.SEQUENCE

    @property
    def outputs(self) -> tuple[str, ...]:
        """A multi-output model's outputs (ModelCard.outputs), as its settings name them;
        none for others."""
        return getattr(self.settings, "outputs", ())

    @property
    def score_template_source(self) -> str:
        """Where an LLM reranker's template came from (ModelCard.score_template_source)."""
        return getattr(self.settings, "score_template_source", "")

    @property
    def chunks_long_input(self) -> bool:
        """Chunking needs per-token states or a vector to average; a classifier has neither."""
        return self.long_input is LongInput.CHUNK and self.head not in (
            HeadKind.SEQUENCE,  # a classifier's, or an LLM reranker's score
            HeadKind.TOWERS,  # the text tower gives one projected vector, not token states
        )

    def char_limit(self, long: bool) -> int:
        """The most characters of one text, checked before tokenizing, so that no text can
        cost more than a bounded tokenization. `long`: the text may be truncated or chunked,
        so it may rightly run past the maximum length."""
        if self.max_input_chars is not None:
            return self.max_input_chars
        per_token = LONG_CHARS_PER_TOKEN if long else CHARS_PER_TOKEN
        return per_token * self.max_input_tokens

    def label(self, label_id: int) -> str:
        return self.labels[label_id] if label_id < len(self.labels) else str(label_id)
