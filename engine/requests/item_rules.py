"""The rules of items (texts, images and audio clips in one list), generic over what a
frame is: items only where a task takes them, never beside texts, no more images than a
request may hold, and each item of a modality its model takes (ModelCard.modalities)."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.families import ORDER, family
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import Image, Item, PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved

# The tasks whose requests may carry items (TextInput.items, ScoreInput.items_1/items_2).
ITEM_TASKS = frozenset({Task.EMBED, Task.CLASSIFY, Task.SCORE})


def item_lists(request: PoolRequest) -> Iterator[tuple[str, tuple[Item, ...]]]:
    """Each item list a request carries, with its field path."""
    if request.task is Task.SCORE:
        for path, items in (("score.items_1", request.items_1), ("score.items_2", request.items_2)):
            if items:
                yield path, items
    elif request.items and request.task is not None:
        yield f"{request.task}.items", request.items


def items_shape(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Items stand in place of texts: never both in one list, only where a task takes
    them, and no more images than the limit per request."""
    request = r.request
    if request.task is None or not (request.items or request.items_1 or request.items_2):
        return  # a text request: nothing to check (the usual case, kept cheap)
    given = list(item_lists(request))
    if request.task not in ITEM_TASKS:
        yield FieldViolation(
            given[0][0],
            f"items (texts and images) are for embed, classify and score, not {request.task}; "
            "send texts",
            "ITEMS_NOT_SUPPORTED_FOR_TASK",
        )
        return
    if request.task is Task.SCORE:
        lists = [
            ("score.text_1", request.text_1, request.items_1),
            ("score.text_2", request.text_2, request.items_2),
        ]
    else:
        lists = [(f"{request.task}.texts", request.texts, request.items)]
    for path, texts, items in lists:
        if texts and items:
            yield FieldViolation(
                path,
                "send texts or items, not both: items hold texts and images together",
                "ITEMS_AND_TEXTS",
            )
    images = sum(isinstance(item, Image) for _, items in given for item in items)
    if images > limits.max_images_per_request:
        yield FieldViolation(
            given[-1][0],
            f"{images} images exceed the limit of {limits.max_images_per_request} per request "
            "(--max-images-per-request); split the request",
            "TOO_MANY_IMAGES",
        )


def modalities(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """An image or audio clip needs a model that takes it (ModelCard.modalities)."""
    request, info = r.request, r.info
    if request.items or request.items_1 or request.items_2:
        for path, items in item_lists(request):
            for i, item in enumerate(items):
                if type(item) is not str and item.modality not in info.modalities:
                    takes = " and ".join(info.modalities)
                    yield FieldViolation(
                        f"{path}[{i}].{item.modality}",
                        f'model "{info.name}" takes {takes} inputs; send {item.modality} '
                        f"inputs to a model whose modalities include {item.modality} "
                        f"({_taking(item.modality)})",
                        "MODALITY_NOT_SUPPORTED",
                    )
                    return


def _taking(modality: str) -> str:
    """The models that take `modality`, as their families name them (Family.media)."""
    return ", ".join(f.media[modality] for f in map(family, ORDER) if modality in f.media)
