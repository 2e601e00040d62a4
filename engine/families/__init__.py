"""One room per model family: each owns its detection, loading, facts, rules, plan and outputs.

A family is a package here whose `__init__` defines `FAMILY`, a `Family`: what the generic
path asks of it once a model is loaded (its rows of the validation table and its planner).
That side is torch-free, since front ends validate and plan. Its torch side, `loading`, is
a module the loader imports only where models load: `read` says whether a folder is of the
family (and what the family reads from it), `load` turns it into a served model.

A new family is one package and one name in ORDER; the generic modules name no family.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pooling_server.engine.errors import FieldViolation
    from pooling_server.engine.models.model_folder import ModelFolder
    from pooling_server.engine.models.model_info import ModelInfo
    from pooling_server.engine.models.model_runner import LoadedModel
    from pooling_server.engine.models.model_spec import ModelSpec
    from pooling_server.engine.models.served import ServedModel
    from pooling_server.engine.requests.output_size import ResponseBudget
    from pooling_server.engine.requests.params import Task
    from pooling_server.engine.requests.plan_parts import Plan
    from pooling_server.engine.requests.resolved import Limits, Resolved

    Check = Callable[[Resolved, Limits], Iterator[FieldViolation]]
    Planner = Callable[[Resolved, ServedModel, Limits], Plan]

# Detection order: the first family whose loading reads a folder as its own serves it. The
# specific layouts come first; the plain encoder takes any folder no other family claims.
ORDER = (
    "towers",
    "clap",
    "llm_reranker",
    "bge_m3",  # before colbert: it refuses a folder with both layouts
    "colbert",
    "splade",
    "token_classifier",
    "cross_encoder",
    "encoder",
)


@dataclass(frozen=True)
class FamilyRules:
    """A family's rows of the validation table, each run in the stage it joins (see
    requests/validation.py's RULES): `shape` with the request's own shape
    (INVALID_ARGUMENT), `model` with what the model can do (FAILED_PRECONDITION),
    `params` with the parameters read on this model (INVALID_ARGUMENT)."""

    shape: tuple[Check, ...] = ()
    model: tuple[Check, ...] = ()
    params: tuple[Check, ...] = ()
    # Run with `model` on the models of every OTHER family: refusing what this family
    # alone serves (a parameter only its models read), saying so.
    elsewhere: tuple[Check, ...] = ()


@dataclass(frozen=True)
class RowSizes:
    """The size of an answer of a row per token that a family's own tasks give
    (embed_multi, embed_outputs), estimated before the forward pass by the output-size
    rules (requests/validation.py's rows_bytes): the bytes of the answer to texts of
    `tokens` tokens each, and the most tokens a text keeps (None: Resolved.token_cap)."""

    answer: Callable[[Resolved, Sequence[int], ResponseBudget], int]
    cap: Callable[[Resolved], int | None] | None = None


@dataclass(frozen=True)
class Family:
    name: str  # ModelInfo.family
    plan: Planner  # a validated request into the sequences to compute and their finishing
    loading: str  # the module (a FamilyLoading) imported where models load
    rules: FamilyRules = FamilyRules()
    # The backends its forward runs on (engine/backends' BackendKind values), and how
    # messages name a model of it where that is not all of them: a module no export
    # follows (a scorer reading two logits, heads of its own) runs on torch only.
    backends: tuple[str, ...] = ("torch", "onnx", "openvino")
    title: str = ""
    # A two-tower family's preprocessing of its inputs that are not texts (a FrameMaker:
    # decoding within bounds into Frames), built from the model's facts in every process
    # that plans, torch-free; None: the family takes texts only.
    preprocessor: Callable[[ModelInfo], Any] | None = None
    # The inputs other than text its models take, each with how a refusal names the models
    # that take it ({"image": "CLIP, SigLIP"}): MODALITY_NOT_SUPPORTED's pointer.
    media: Mapping[str, str] = field(default_factory=dict)
    # Its models classify zero-shot over the candidate labels a request names: a model's
    # template for them (--label-template, or the family's); None: they do not.
    label_template: Callable[[ModelInfo], str] | None = None
    # Whether it reads a score request's prompt as an instruction (an LLM reranker's
    # template), where other models refuse a prompt on score.
    instruction: bool = False
    # The type of its ModelInfo.settings (a frozen dataclass), so that a front-end process
    # gets them typed from an engine process's JSON; Any: none.
    settings: Any = Any
    # Why a model lacks a task, where the answer is this family: asked of every family
    # (in ORDER) when a model refuses a task, the first non-empty text appended.
    task_hint: Callable[[Task, ModelInfo], str] | None = None
    # Its own refusal of a task its model lacks, in place of TASK_NOT_SUPPORTED (a decoder
    # LM served as an encoder without a score template: SCORE_TEMPLATE_MISSING).
    task_refusal: Callable[[Task, ModelInfo], FieldViolation | None] | None = None
    rows: RowSizes | None = None  # its own tasks' rows per token (None: none)
    # Slow tokenizers its folders ship that transformers cannot convert to a fast one: the
    # class name -> the tokenizer as a `tokenizers.Tokenizer` (models/model_folder.py's
    # fast_tokenizer checks it against the slow one).
    converters: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadContext:
    """Where and how a model loads: the same for every family (torch types, kept as Any so
    that this module stays torch-free)."""

    spec: ModelSpec
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    attn_implementation: str | None = None
    is_default: bool = False
    runtime: Any = None  # backends.RuntimeSettings | None
    threads: int = 1
    cuda_graphs: Any = None  # models.cuda_graphs.GraphSettings | None


class FamilyLoading(Protocol):
    def read(self, folder: ModelFolder) -> object | None:
        """What this family reads from the folder beyond the generic reading, or None
        where the folder is not of this family."""

    def load(self, folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
        """The model loaded on the context's device, with its facts (ModelInfo.family set
        to this family's name) and its forward."""


@cache
def family(name: str) -> Family:
    """The family by its name (ModelInfo.family), imported on first use."""
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def family_of(info: ModelInfo) -> Family:
    return family(info.family)


def loading(name: str) -> FamilyLoading:
    """A family's torch side: imported only on the loading path."""
    return importlib.import_module(family(name).loading)  # type: ignore[return-value]
