"""Request building and response conversion shared by the sync and async clients.

Pure functions only (no I/O), so both clients stay thin wrappers around one transport call,
and the streaming path (``_chunking``) splits one prepared request into chunks and reuses the
same input filling and conversion.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from pooling_client import _encodings, _images
from pooling_client._progress import UseTqdm
from pooling_client.outputs import (
    PoolingResults,
    ServerTiming,
    Usage,
    classification_request_outputs,
    embedding_request_outputs,
    multi_vector_request_outputs,
    outputs_request_outputs,
    pooling_request_outputs,
    scoring_request_outputs,
    sparse_embedding_request_outputs,
)
from pooling_client.params import LateChunking, PoolingParams, check_task
from pooling_client.v1 import pooling_pb2

#: Tasks that take a TextInput (everything but score).
TEXT_TASKS: tuple[str, ...] = (
    "embed",
    "classify",
    "token_embed",
    "token_classify",
    "embed_multi",
    "embed_outputs",
)
#: Tasks ``encode`` accepts; "embed" and "classify" delegate to embed()/classify().
ENCODE_TASKS: tuple[str, ...] = (
    "token_embed",
    "token_classify",
    "embed",
    "classify",
    "embed_multi",
)

#: How the "[SEP]" form of score input separates query from document.
SEP_TOKEN = "[SEP]"

_CONVERTERS: dict[str, Callable[[pooling_pb2.PoolResponse], list[Any]]] = {
    "embed": embedding_request_outputs,
    "classify": classification_request_outputs,
    "score": scoring_request_outputs,
    "token_embed": pooling_request_outputs,
    "token_classify": pooling_request_outputs,
    "embed_sparse": sparse_embedding_request_outputs,
    "embed_multi": multi_vector_request_outputs,
    "embed_outputs": outputs_request_outputs,
}


class CallArgs(NamedTuple):
    """The arguments every pooling method takes alike, handed on to the one request path
    (the client's _pool) as one value rather than six positional ones."""

    pooling_params: PoolingParams | None
    truncate_prompt_tokens: int | None
    model: str | None
    timeout: float | None
    request_id: str | None
    use_tqdm: UseTqdm


def new_request_id() -> str:
    """A fresh request id for calls that do not name one."""
    return uuid.uuid4().hex


def as_texts(prompts: str | Iterable[str], name: str = "prompts") -> list[str]:
    """Normalise one text or a sequence of texts to a list, rejecting non-strings."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
    return texts


def split_sep(text: str) -> tuple[str, str]:
    """Split "query [SEP] doc" on the first [SEP], dropping the whitespace around it."""
    query, sep, doc = text.partition(SEP_TOKEN)
    if not sep:
        raise ValueError(f"Score input {text!r} has no {SEP_TOKEN} separator")
    return query.rstrip(), doc.lstrip()


def split_pairs(data: str | Iterable[Any]) -> tuple[list[str], list[str]]:
    """Split (text_1, text_2) tuples or "q [SEP] d" strings into equal-length N:N lists."""
    items = [data] if isinstance(data, str) else list(data)
    text_1: list[str] = []
    text_2: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            query, doc = split_sep(item)
        elif isinstance(item, (tuple, list)):
            if len(item) != 2:
                raise ValueError(f"data_1[{i}] must be a (text_1, text_2) pair, got {len(item)}")
            query, doc = item
            if not isinstance(query, str) or not isinstance(doc, str):
                raise TypeError(f"data_1[{i}] must hold two str")
        else:
            raise TypeError(
                f"data_1[{i}] must be a (text_1, text_2) pair or a '{SEP_TOKEN}' string, "
                f"got {type(item).__name__}"
            )
        text_1.append(query)
        text_2.append(doc)
    return text_1, text_2


def score_texts(
    data_1: str | Iterable[Any], data_2: str | Iterable[Any] | None
) -> tuple[list[Any], list[Any]]:
    """Resolve score()'s arguments into text_1/text_2 lists (shapes are checked by the
    server); with an image on either side (data_2 given), both sides as items."""
    if data_2 is None:
        return split_pairs(data_1)
    one, two = _images.as_inputs(data_1, "data_1"), _images.as_inputs(data_2, "data_2")
    if _images.has_items(one) or _images.has_items(two):
        return _images.as_items(one), _images.as_items(two)
    return one, two


def resolve_params(
    task: str, pooling_params: PoolingParams | None, truncate_prompt_tokens: int | None
) -> PoolingParams:
    """Merge the truncate_prompt_tokens kwarg into the params (the kwarg wins), then verify."""
    params = pooling_params if pooling_params is not None else PoolingParams()
    if truncate_prompt_tokens is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    params.verify(task)
    return params


def pool_request(
    task: str,
    inputs: list[str] | tuple[list[str], list[str]],
    *,
    pooling_params: PoolingParams | None = None,
    truncate_prompt_tokens: int | None = None,
    model: str | None = None,
    request_id: str | None = None,
    encoding: str | None = None,
    input_options: dict[str, Any] | None = None,
    prompt_name: str | None = None,
    prompt: str | None = None,
    late_chunking: LateChunking | None = None,
) -> pooling_pb2.PoolRequest:
    """Build a verified PoolRequest whose input case is named by ``task``.

    ``inputs`` is a list of texts, or for score a (text_1, text_2) pair of lists.
    ``input_options`` are fields of the input case message besides its inputs (embed_sparse's
    ``top_k`` and ``return_tokens``, see :func:`sparse_options`). ``encoding`` (embed and
    token_embed) names how the values travel (None: repeated float).
    ``prompt_name`` (one of the model's prompts) or ``prompt`` (a text) is prepended to every
    text; neither: the model's default prompt, if it has one.
    """
    check_task(task)
    params = resolve_params(task, pooling_params, truncate_prompt_tokens)
    _encodings.check_encoding(encoding, task)
    request = pooling_pb2.PoolRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        model=model or "",
        params=params.to_proto(task),
    )
    if encoding is not None:
        request.encoding = _encodings.ENCODINGS[encoding]  # type: ignore[assignment]
    if prompt_name is not None and prompt is not None:
        raise ValueError("pass prompt_name or prompt, not both")
    if prompt_name is not None:
        request.prompt_name = prompt_name
    if prompt is not None:
        request.prompt = prompt
    if late_chunking is not None:
        request.late_chunking.CopyFrom(late_chunking.to_proto())
    for name, value in (input_options or {}).items():
        if isinstance(value, (list, tuple)):  # a repeated field (candidate_labels)
            getattr(getattr(request, task), name).extend(value)
        else:
            setattr(getattr(request, task), name, value)
    set_inputs(request, task, inputs)
    return request


def sparse_options(top_k: int | None, return_tokens: bool) -> dict[str, Any]:
    """embed_sparse's SparseInput fields, checked: top_k None or 0 keeps every weight."""
    if top_k is None:
        top_k = 0
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: every non-zero weight), got {top_k}")
    return {"top_k": top_k, "return_tokens": bool(return_tokens)}


def outputs_options(
    dense: bool, sparse: bool, multi: bool, sparse_top_k: int | None, return_tokens: bool
) -> dict[str, Any]:
    """embed_outputs' OutputsInput fields, checked: at least one output asked for."""
    if not (dense or sparse or multi):
        raise ValueError("ask for at least one output: dense, sparse or multi")
    top_k = sparse_options(sparse_top_k, return_tokens)
    return {
        "dense": bool(dense),
        "sparse": bool(sparse),
        "multi": bool(multi),
        "sparse_top_k": top_k["top_k"],
        "return_tokens": top_k["return_tokens"],
    }


def set_inputs(
    request: pooling_pb2.PoolRequest, task: str, inputs: list[str] | tuple[list[str], list[str]]
) -> None:
    """Append ``inputs`` to the request's ``task`` input case (texts, or score's text pairs)."""
    if task == "score":
        text_1, text_2 = inputs
        if _images.has_items(text_1) or _images.has_items(text_2):  # an image-text model's
            request.score.items_1.extend(text_1)
            request.score.items_2.extend(text_2)
            return
        request.score.text_1.extend(text_1)
        request.score.text_2.extend(text_2)
    else:
        if isinstance(inputs, tuple):
            raise TypeError(f"Task {task} takes a list of texts, not text pairs")
        case = getattr(request, task)
        (case.items if _images.has_items(inputs) else case.texts).extend(inputs)


def expected_outputs(request: pooling_pb2.PoolRequest) -> int:
    """How many outputs a PoolRequest should produce: one per text, or per pair for score."""
    case = request.WhichOneof("input")
    if case == "score":
        score = request.score
        text_1, text_2 = score.text_1 or score.items_1, score.text_2 or score.items_2
        return len(text_2) if len(text_1) == 1 else len(text_1)
    if not case:
        return 0
    inputs = getattr(request, case)
    return len(inputs.texts) or len(getattr(inputs, "items", ()))


def pool_outputs(
    task: str, request: pooling_pb2.PoolRequest, response: pooling_pb2.PoolResponse
) -> list[Any]:
    """Convert a PoolResponse into the task's request outputs, checking it answers ``request``."""
    return convert_outputs(task, response, expected_outputs(request))


def pool_results(
    task: str,
    request: pooling_pb2.PoolRequest,
    response: pooling_pb2.PoolResponse,
    trailing_metadata: Iterable[Any] | None = None,
) -> PoolingResults[Any]:
    """pool_outputs, with the response's usage and the call's timing trailers."""
    outputs = pool_outputs(task, request, response)
    usage = Usage.from_proto(response.usage)
    return PoolingResults(outputs, usage, ServerTiming.from_metadata(trailing_metadata))


def convert_outputs(task: str, response: pooling_pb2.PoolResponse, expected: int) -> list[Any]:
    """Convert a PoolResponse into the task's request outputs, checking there are ``expected``."""
    outputs = _CONVERTERS[task](response)
    if len(outputs) != expected:
        raise ValueError(
            f"PoolResponse {response.request_id!r} has {len(outputs)} outputs, expected {expected}"
        )
    return outputs


def check_encode_task(pooling_task: str) -> None:
    """Raise ValueError unless encode() can run ``pooling_task``."""
    if pooling_task not in ENCODE_TASKS:
        raise ValueError(
            f"encode() does not support pooling_task={pooling_task!r}; "
            f"expected one of {list(ENCODE_TASKS)} (use score() for scoring)"
        )


def rerank_request(
    query: str,
    documents: str | Sequence[Any],
    *,
    top_n: int | None = None,
    return_documents: bool = False,
    pooling_params: PoolingParams | None = None,
    truncate_prompt_tokens: int | None = None,
    model: str | None = None,
    request_id: str | None = None,
    instruction: str | None = None,
) -> pooling_pb2.RerankRequest:
    """Build a verified RerankRequest; its params are score's (rerank runs score 1:N).
    ``instruction``: an LLM reranker's (its score template's {instruction}); sent when set."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if top_n is None:
        top_n = 0
    if isinstance(top_n, bool) or not isinstance(top_n, int):
        raise TypeError(f"top_n must be an int or None, got {type(top_n).__name__}")
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0 (0 or None: every document), got {top_n}")
    if instruction is not None and not isinstance(instruction, str):
        raise TypeError(f"instruction must be a str or None, got {type(instruction).__name__}")
    params = resolve_params("score", pooling_params, truncate_prompt_tokens)
    request = pooling_pb2.RerankRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        model=model or "",
        query=query,
        documents=[],
        top_n=top_n,
        return_documents=bool(return_documents),
        params=params.to_proto("score"),
    )
    given = _images.as_inputs(documents, "documents")  # on an image model, may hold images
    (request.items if _images.has_items(given) else request.documents).extend(given)
    if instruction is not None:
        request.instruction = instruction
    return request


def tokenize_request(
    prompts: str | Sequence[str], *, model: str | None, add_special_tokens: bool | None
) -> pooling_pb2.TokenizeRequest:
    """Build a TokenizeRequest; add_special_tokens is sent only when set."""
    request = pooling_pb2.TokenizeRequest(model=model or "", texts=as_texts(prompts))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request
