"""An LLM reranker's plan: each score pair read through the model's score template."""

from __future__ import annotations

import numpy as np

from pooling_server.engine.families.llm_reranker.score_template import ScoreTemplate
from pooling_server.engine.models.model_info import Activation
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import activate
from pooling_server.engine.requests.outputs import Score
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plan_parts import Plan, use_activation
from pooling_server.engine.requests.plans import TextParts, pair_index, plan_text, plan_texts
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.size_rules import check_tokenized


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    if resolved.request.task is Task.SCORE:
        return _plan_score(resolved, model, limits)
    return plan_text(resolved, model, limits)  # score is its one task: the rest refused


def _plan_score(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Each pair read through the model's score template (score_template.py), the
    request's prompt as the template's {instruction}; the pair part is always truncated to
    what the request's truncation (else the maximum length) leaves beside the template.
    The runner returns logit(true) - logit(false), so the score is its sigmoid: the
    softmax over the two logits' true entry, as the model card computes it."""
    request, info = resolved.request, model.info
    template = info.settings
    assert isinstance(template, ScoreTemplate)
    truncate = resolved.truncate
    max_tokens = info.max_input_tokens if truncate in (None, -1) else truncate
    pairs = [(request.text_1[i], request.text_2[j]) for i, j in pair_index(request)]
    sequences = template.sequences(
        model.tokenizer, pairs, request.prompt, max_tokens, resolved.side
    )
    check_tokenized(resolved, limits, "score.text_2", [len(e) for e in sequences])
    texts = [TextParts(e, [e]) for e in sequences]
    activation = Activation.SIGMOID if use_activation(request, True) else Activation.IDENTITY

    def finish_one(text: TextParts, raws: list[np.ndarray]) -> Score:
        return Score(float(activate(raws[0].astype(np.float32), activation)[0]))

    return plan_texts(texts, False, finish_one)
