"""A token classifier's plan: a class row per token of each text, chunks joined back."""

from __future__ import annotations

import numpy as np

from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.outputs import TokenRows
from pooling_server.engine.requests.plan_parts import Plan
from pooling_server.engine.requests.plans import (
    TextParts,
    class_values,
    plan_per_text,
    rows_output,
    token_rows,
)
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    return plan_per_text(resolved, model, limits, _token_classes, keep_tokens=True)


def _token_classes(
    request: PoolRequest, info: ModelInfo, text: TextParts, raws: list[np.ndarray]
) -> TokenRows:
    probs = class_values(request, info, token_rows(text, raws))
    label_ids = [int(i) for i in np.argmax(probs, axis=-1)]
    return rows_output(text, probs, label_ids, [info.label(i) for i in label_ids])
