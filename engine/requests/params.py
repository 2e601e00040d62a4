"""Pooling tasks and parameters, with the table of which parameter each task accepts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum


class Task(StrEnum):
    EMBED = "embed"
    CLASSIFY = "classify"
    SCORE = "score"
    TOKEN_EMBED = "token_embed"
    TOKEN_CLASSIFY = "token_classify"
    EMBED_SPARSE = "embed_sparse"
    EMBED_MULTI = "embed_multi"  # ColBERT: one normalised, projected row per token
    EMBED_OUTPUTS = "embed_outputs"  # bge-m3: any of dense, sparse and multi from one pass


class Output(StrEnum):
    """A multi-output (bge-m3) model's outputs, as embed_outputs names them."""

    DENSE = "dense"  # the first token's state, normalised as embed
    SPARSE = "sparse"  # lexical weights, as embed_sparse
    MULTI = "multi"  # the ColBERT matrix, as embed_multi


class OutputEncoding(StrEnum):
    """How embed and token_embed values travel (see EmbeddingEncoding in the schema)."""

    FLOAT = "float"  # repeated float, the default
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    BINARY = "binary"
    UBINARY = "ubinary"
    INT8 = "int8"
    UINT8 = "uint8"


@dataclass(frozen=True)
class OutputWeights:
    """score on a multi-output model: each output's score weighs this much in the combined
    one, sum(weight * score) / sum(weight), as bge-m3's compute_score weighs them."""

    dense: float = 0.0
    sparse: float = 0.0
    multi: float = 0.0

    def of(self, output: Output) -> float:
        return float(getattr(self, output.value))


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams: None means "the model's default"."""

    use_activation: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    output_weights: OutputWeights | None = None  # score on a multi-output model

    def set_fields(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


# Which parameters each task accepts (as vLLM's pooling_params does).
TASK_PARAMS: dict[Task, frozenset[str]] = {
    Task.EMBED: frozenset({"use_activation", "dimensions", "truncate_prompt_tokens"}),
    Task.TOKEN_EMBED: frozenset({"use_activation", "dimensions", "truncate_prompt_tokens"}),
    Task.CLASSIFY: frozenset({"use_activation", "truncate_prompt_tokens"}),
    Task.SCORE: frozenset({"use_activation", "truncate_prompt_tokens", "output_weights"}),
    Task.TOKEN_CLASSIFY: frozenset({"use_activation", "truncate_prompt_tokens"}),
    Task.EMBED_SPARSE: frozenset({"use_activation", "truncate_prompt_tokens"}),
    Task.EMBED_MULTI: frozenset({"truncate_prompt_tokens"}),
    # use_activation: the dense vector's normalisation (the matrix is always normalised).
    Task.EMBED_OUTPUTS: frozenset({"use_activation", "truncate_prompt_tokens"}),
}

# Which tasks take a prompt (PoolRequest.prompt_name / prompt): those that embed, as
# sentence-transformers' encode() prompts; it prompts no classifier or cross-encoder, and
# score's two sides would need different ones. embed_multi's prompt_name "query" or
# "document" picks the mode (the multi-vector family's encoder), as MultiVectorEncoder's
# prompts do.
PROMPT_TASKS: frozenset[Task] = frozenset(
    {Task.EMBED, Task.TOKEN_EMBED, Task.EMBED_SPARSE, Task.EMBED_MULTI, Task.EMBED_OUTPUTS}
)
