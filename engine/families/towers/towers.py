"""Plans on a two-tower model, image-text (CLIP, SigLIP, SigLIP 2) or audio-text (CLAP,
engine/families/clap): embed, score and zero-shot classify over items, each a text or an
input of the model's other modality.

Runs on the front end's intake threads, like tokenizing: texts become token sequences,
images (audio clips) are decoded within the request's bounds and preprocessed into Frames,
by the model's image processor or by its family's preprocessor (a FrameMaker). Each
tower's vectors come back from the queue; the finish here compares them (cosine, logits
over the candidate labels) where the last batch ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import numpy as np

from pooling_server.engine.inputs.modality import Frame, Modality
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.model_info import Activation, ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import activate, cosine, normalize
from pooling_server.engine.requests.outputs import Classification, Embedding, ItemOutput, Score
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plan_parts import Plan, finish_vector, use_activation
from pooling_server.engine.requests.request import Image, Item, Media, PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.size_rules import check_tokenized

Unit = TokenSequence | Frame  # one input as a tower computes it


@runtime_checkable
class FrameMaker(Protocol):
    """A family's preprocessing of its non-text inputs (Family.preprocessor): each decoded
    within the limits, refused at its own path (`embed.items[2].audio`), into a Frame."""

    def frames(self, items: list[tuple[int, Media]], limits: Limits, path: str) -> list[Frame]: ...


def plan_towers(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Every input of the request computed once by its tower, then finished per task."""
    request = resolved.request
    if request.task is Task.SCORE:
        return _plan_score(resolved, model, limits)
    items: Sequence[Item] = request.items or request.texts
    path = f"{request.task}.items" if request.items else f"{request.task}.texts"
    units = prepare(resolved, model, limits, items, path)
    if request.task is Task.CLASSIFY:
        return _plan_zero_shot(resolved, model, limits, units)
    info = model.info

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        return [_embedding(request, info, unit, raw) for unit, raw in zip(units, raws, strict=True)]

    return Plan([(unit, False) for unit in units], finish)


def prepare(
    resolved: Resolved, model: ServedModel, limits: Limits, items: Sequence[Item], path: str
) -> list[Unit]:
    """Texts tokenized as the request resolved them (prompt, truncation, side) and checked
    by the tokenized rules; images (audio clips) decoded and preprocessed, each refused at
    its own path (`embed.items[2].image`)."""
    texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
    units: list[Unit] = [None] * len(items)  # type: ignore[list-item]
    if texts:
        prompt = resolved.prompt or ""
        sequences = model.tokenizer.tokenize(
            [prompt + text for _, text in texts], truncate=resolved.truncate, side=resolved.side
        )
        counts = [0] * len(items)
        for (i, _), sequence in zip(texts, sequences, strict=True):
            counts[i] = len(sequence)
            units[i] = sequence
        check_tokenized(resolved, limits, path, counts)
    media = [(i, item) for i, item in enumerate(items) if not isinstance(item, str)]
    if media:
        maker = model.images
        if isinstance(maker, FrameMaker):
            frames = maker.frames(media, limits, path)
        else:
            frames = _frames(model, limits, media, path)  # type: ignore[arg-type]
        for (i, _), frame in zip(media, frames, strict=True):
            units[i] = frame
    return units


def _frames(
    model: ServedModel, limits: Limits, images: list[tuple[int, Image]], path: str
) -> list[Frame]:
    from pooling_server.engine.inputs.image_decoding import (
        open_image,  # Pillow: loaded where images are served
    )

    processor = model.images
    assert processor is not None  # validation refuses images to a text-only model
    # One at a time: only one decoded picture (up to --max-image-pixels) is held at once,
    # however many images the request carries; the processor's resize target is bounded
    # by the same limit before decoding, and the picture becomes RGB a channel at a time.
    frames: list[Frame] = []
    for i, image in images:
        opened = open_image(image, limits, f"{path}[{i}].image", processor.target)
        try:
            frames.append(processor.frame(opened.picture, opened.transpose))
        finally:
            opened.close()
    return frames


def _modality(info: ModelInfo, unit: Unit) -> Modality:
    """A text, or the one other modality the model takes (its frames')."""
    return Modality(info.modalities[-1]) if type(unit) is Frame else Modality.TEXT


def _embedding(request: PoolRequest, info: ModelInfo, unit: Unit, raw: np.ndarray) -> Embedding:
    """As embed finishes a text's vector (dimensions, normalisation, encoding), with the
    item's modality."""
    return replace(finish_vector(request, info, raw), modality=_modality(info, unit))


def _plan_score(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Text-image, image-image and text-text pairs alike: the cosine of the two vectors
    (1:1, 1:N, N:N), each input computed once."""
    request = resolved.request
    firsts = prepare(
        resolved,
        model,
        limits,
        request.items_1 or request.text_1,
        "score.items_1" if request.items_1 else "score.text_1",
    )
    seconds = prepare(
        resolved,
        model,
        limits,
        request.items_2 or request.text_2,
        "score.items_2" if request.items_2 else "score.text_2",
    )
    one = len(firsts) == 1
    pairs = [(0 if one else i, i) for i in range(len(seconds))]

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        first, second = raws[: len(firsts)], raws[len(firsts) :]
        return [Score(cosine(first[i], second[j])) for i, j in pairs]

    return Plan([(unit, False) for unit in firsts + seconds], finish)


def _plan_zero_shot(
    resolved: Resolved, model: ServedModel, limits: Limits, units: list[Unit]
) -> Plan:
    """Each candidate label in its template through the text tower, then per item the
    model's own logits over them: exp(logit_scale) * cosine (+ logit_bias), softmaxed for
    CLIP and CLAP, each sigmoid'd for SigLIP (use_activation false: the logits)."""
    request, info = resolved.request, model.info
    towers = info.settings
    assert towers is not None
    labels = request.candidate_labels
    template = request.label_template or towers.label_template
    prompts = [template.replace("{label}", label) for label in labels]
    sequences = model.tokenizer.tokenize(prompts, truncate=resolved.truncate, side=resolved.side)
    check_tokenized(resolved, limits, "classify.candidate_labels", [len(e) for e in sequences])
    scale = float(np.exp(towers.logit_scale))
    bias = towers.logit_bias or 0.0
    softmax = towers.family != "siglip"
    activation = Activation.IDENTITY
    if use_activation(request, True):
        activation = Activation.SOFTMAX if softmax else Activation.SIGMOID

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        vectors = normalize(np.stack(raws[: len(units)]).astype(np.float32))
        label_vectors = normalize(np.stack(raws[len(units) :]).astype(np.float32))
        logits = (scale * vectors @ label_vectors.T + bias).astype(np.float32)
        outputs: list[ItemOutput] = []
        for unit, row in zip(units, logits, strict=True):
            probs = activate(row, activation)
            best = int(np.argmax(probs))
            outputs.append(Classification(probs, best, labels[best], _modality(info, unit)))
        return outputs

    work = [(unit, False) for unit in [*units, *sequences]]
    return Plan(work, finish)
