"""What a model's folder says before its weights load (ModelFolder), read once by the
loader and used by every loading step, the image towers' included; and the facts derived
from it alone: the hub revision and the longest input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from engine.model_info import HeadKind, PoolingType, SpladeActivation, SpladeStrategy
from engine.model_spec import DEFAULT_MODEL, ModelSpec
from engine.multi_vector import MultiVectorSettings
from engine.score_template import ScoreTemplate
from engine.tokenization import ModelTokenizer

if TYPE_CHECKING:
    import torch

FALLBACK_MAX_TOKENS = 512


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooling_type: PoolingType | None
    normalize: bool
    max_seq_length: int | None
    include_prompt: bool = True  # the Pooling module's include_prompt
    # SpladePooling's pooling_strategy and activation_function (a SparseEncoder folder).
    splade: tuple[SpladeStrategy, SpladeActivation] | None = None
    dense: tuple[Path, ...] = ()  # Dense module folders, applied in order after pooling


@dataclass
class ModelFolder:
    """What a model's folder says before its weights load: read once, used by every step."""

    path: Path
    hub: dict[str, Any]  # trust_remote_code and revision, for every from_pretrained
    config: PretrainedConfig  # with --hf-overrides applied
    st: SentenceTransformersConfig | None
    head: HeadKind
    hf_tokenizer: Any
    tokenizer: ModelTokenizer
    prompts: dict[str, str]
    default_prompt_name: str | None
    template: ScoreTemplate | None = None  # LLM_SCORE: the pairs' template
    # A ColBERT folder: its query/document settings and its token projection's folder.
    multi_vector: MultiVectorSettings | None = None
    multi_vector_dense: Path | None = None
    # A bge-m3 folder: its sparse_linear.pt and colbert_linear.pt.
    multi_output_heads: tuple[Path, Path] | None = None


def loaded_revision(source: str, path: Path, revision: str | None) -> str:
    """The hub revision a model came from: as asked, else the snapshot's commit; "" for a
    local folder or the embedded default."""
    if path == Path(source).expanduser() or (source == DEFAULT_MODEL and revision is None):
        return ""
    if revision:
        return revision
    return path.name if path.parent.name == "snapshots" else ""


def served_fields(
    spec: ModelSpec, folder: ModelFolder, module: torch.nn.Module, is_default: bool
) -> dict[str, Any]:
    """The ModelInfo fields every kind of model fills alike, from its spec, its folder and
    its loaded weights (where they sit and in what dtype), so the loaders state only what
    differs."""
    weights = next(module.parameters())
    return {
        "name": spec.served_name,
        "truncation_side": spec.truncation_side,
        "max_input_chars": spec.max_input_chars,
        "is_default": is_default,
        "dtype": str(weights.dtype).removeprefix("torch."),
        "device": str(weights.device),
        "revision": loaded_revision(spec.source, folder.path, spec.revision),
    }


def max_input_tokens(config: PretrainedConfig, tokenizer: Any, st_max: int | None) -> int:
    limits = [st_max, getattr(config, "max_position_embeddings", None)]
    if tokenizer.model_max_length and tokenizer.model_max_length < 1_000_000:
        limits.append(tokenizer.model_max_length)
    known = [int(limit) for limit in limits if limit]
    return min(known) if known else FALLBACK_MAX_TOKENS
