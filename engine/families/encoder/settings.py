"""The pooled encoder's own facts (ModelInfo.settings of its models), and the refusal they
imply: a decoder LM checkpoint served as an encoder has no score template, so its score
would be a cosine of last-token states, which is no reranker's score."""

from __future__ import annotations

from dataclasses import dataclass

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.families.llm_reranker.score_template import SCORE_TEMPLATE_FILE
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.params import Task


@dataclass(frozen=True)
class EncoderSettings:
    # A decoder LM with its LM head (its architecture, ForCausalLM...) served without a
    # score template: listed without score, which it refuses saying how to give one.
    decoder_lm_without_template: bool = False


def score_refusal(task: Task, info: ModelInfo) -> FieldViolation | None:
    """Why a decoder LM served without a template refuses score (Family.task_refusal):
    SCORE_TEMPLATE_MISSING, naming both ways to give one; None for any other model."""
    settings = info.settings
    if task is not Task.SCORE or not isinstance(settings, EncoderSettings):
        return None
    if not settings.decoder_lm_without_template:
        return None
    return FieldViolation(
        "model",
        f'model "{info.name}" is a decoder LM ({info.architecture}) served without a score '
        "template, so it cannot score pairs as an LLM reranker does; serve it with "
        f"--score-template and --score-tokens, or put a {SCORE_TEMPLATE_FILE} in its folder",
        "SCORE_TEMPLATE_MISSING",
    )
