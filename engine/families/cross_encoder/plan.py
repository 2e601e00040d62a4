"""A classifier's and a cross-encoder's plans: a class row per text, a score per pair."""

from __future__ import annotations

import numpy as np

from pooling_server.engine.models.model_info import Activation, ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import activate
from pooling_server.engine.requests.outputs import Classification, Score
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plan_parts import Plan, use_activation
from pooling_server.engine.requests.plans import (
    TextParts,
    class_values,
    pair_index,
    plan_per_text,
    plan_texts,
    tokenize_texts,
)
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    if resolved.request.task is Task.SCORE:
        return _plan_pairs(resolved, model, limits)
    return plan_per_text(resolved, model, limits, _classification)


def _classification(
    request: PoolRequest, info: ModelInfo, text: TextParts, raws: list[np.ndarray]
) -> Classification:
    probs = class_values(request, info, raws[0])
    label_id = int(np.argmax(probs))
    return Classification(probs, label_id, info.label(label_id))


def _plan_pairs(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Each pair tokenized as one sequence (text_1, text_2), its one logit sigmoid'd."""
    request = resolved.request
    pairs = pair_index(request)
    texts = tokenize_texts(
        resolved,
        model,
        limits,
        [request.text_1[i] for i, _ in pairs],
        "score.text_2",
        [request.text_2[j] for _, j in pairs],
    )
    activation = Activation.SIGMOID if use_activation(request, True) else Activation.IDENTITY

    def finish_one(text: TextParts, raws: list[np.ndarray]) -> Score:
        return Score(float(activate(raws[0].astype(np.float32), activation)[0]))

    return plan_texts(texts, False, finish_one)
