"""Zero-shot classification's rows of the validation table: candidate labels, their
template and their share of the request bound, and a model that classifies zero-shot.
They run on every model, so that one which does not classify zero-shot refuses labels by
name; which models do, and their templates, their families say (Family.label_template)."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.families import ORDER, family, family_of
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.character_rules import inputs_of
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.shape_rules import too_many_inputs

DEFAULT_LABEL_TEMPLATE = "a photo of a {label}."


def model_template(info: ModelInfo) -> str:
    """The template a label goes in where the request names none: the model's own (its
    family's), or the default for a model that does not classify zero-shot."""
    own = family_of(info).label_template
    return own(info) if own is not None else DEFAULT_LABEL_TEMPLATE


def candidate_labels(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Zero-shot labels belong to classify: each non-blank, no more than a request's
    inputs, in a template that places the label."""
    request = r.request
    labels, template = request.candidate_labels, request.label_template
    path = "classify.candidate_labels"
    if not labels:
        if template is not None and request.task is Task.CLASSIFY:
            yield FieldViolation(
                "classify.label_template",
                "label_template shapes candidate_labels, and there are none; send some",
                "CANDIDATE_LABELS_MISSING",
            )
        return
    if request.task is not Task.CLASSIFY:
        yield FieldViolation(
            path,
            f"candidate labels are for zero-shot classify, not {request.task}",
            "CANDIDATE_LABELS_NOT_SUPPORTED_FOR_TASK",
        )
        return
    if len(labels) > limits.max_client_batch_size:
        yield too_many_inputs(path, len(labels), limits.max_client_batch_size)
        return
    for i, label in enumerate(labels):
        if not label.strip():
            yield FieldViolation(
                f"{path}[{i}]", "a label must not be blank", "CANDIDATE_LABEL_EMPTY"
            )
    if template is not None and "{label}" not in template:
        yield FieldViolation(
            "classify.label_template",
            'the template must hold "{label}", where each candidate label goes '
            f'(default "{DEFAULT_LABEL_TEMPLATE}")',
            "LABEL_TEMPLATE_INVALID",
        )
    limit = r.info.char_limit(r.may_run_long)
    default = model_template(r.info)
    reads = max((template or default).count("{label}"), 1)  # a template may repeat it
    longest = reads * max(len(label) for label in labels) + len(template or default)
    if longest > limit:
        yield FieldViolation(
            path,
            f"a label in its template has {longest} characters, more than this model's "
            f"limit of {limit}",
            "INPUT_TOO_LONG",
        )


def zero_shot_model(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Candidate labels on classify need a model that classifies zero-shot (one without
    classify at all is the task rule's to refuse)."""
    request, info = r.request, r.info
    if not request.candidate_labels:
        return
    classifies = request.task is Task.CLASSIFY and Task.CLASSIFY in info.tasks
    if classifies and family_of(info).label_template is None:
        zero_shot = [f for f in map(family, ORDER) if f.label_template is not None]
        kinds = " or ".join(f"{modality}-text" for f in zero_shot for modality in f.media)
        names = ", ".join(name for f in zero_shot for name in f.media.values())
        yield FieldViolation(
            "classify.candidate_labels",
            f'model "{info.name}" classifies into its own labels; zero-shot candidate labels '
            f"need an {kinds} model ({names})",
            "ZERO_SHOT_NOT_SUPPORTED",
        )


def label_total(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Zero-shot labels are texts too, each read in its template: counted with the
    request's texts (each with its prompt) against the request bound, where the texts
    alone are within it (their lengths are candidate_labels')."""
    request = r.request
    if not request.candidate_labels or request.task is not Task.CLASSIFY:
        return
    if request.num_items > limits.max_client_batch_size:
        return  # the batch size rule speaks for a request this large
    prompt = len(r.prompt or "")
    texts = sum(len(t) + prompt for _, ts in inputs_of(request) for t in ts)
    template = request.label_template
    if template is None:
        template = model_template(r.info)
    labels = request.candidate_labels
    reads = max(template.count("{label}"), 1)  # each label as often as its template reads it
    total = texts + reads * sum(map(len, labels)) + len(labels) * len(template)
    if total > limits.max_request_chars >= texts:
        yield FieldViolation(
            "classify.candidate_labels",
            f"the texts and the labels in their template hold {total} characters together, "
            f"more than the limit of {limits.max_request_chars} per request "
            "(--max-request-chars); send fewer or shorter labels",
            "REQUEST_TOO_LARGE",
        )
