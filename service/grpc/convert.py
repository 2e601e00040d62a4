"""Protobuf <-> engine types. No rules here: validation lives in engine/requests/validation.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings
from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.models.model_info import ModelInfo, PoolingType
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import (
    Classification,
    Embedding,
    LateChunks,
    MultiVector,
    PoolResult,
    RerankResult,
    Score,
    SparseEmbedding,
    TextOutputs,
    TokenRows,
)
from pooling_server.engine.requests.params import (
    Output,
    OutputEncoding,
    OutputWeights,
    PoolingParams,
    Task,
)
from pooling_server.engine.requests.request import (
    Audio,
    ChunkRule,
    Image,
    Item,
    LateChunking,
    PoolRequest,
    RerankRequest,
)
from pooling_server.engine.requests.size_rules import output_too_large
from pooling_server.engine.requests.validation import unknown_value
from pooling_server.engine.scheduling.engine import Tokenized, TokenizedText
from pooling_server.service.byte_layout import Layout, varint, varint_lengths
from pooling_server.service.proto import pooling_pb2 as pb

TASK_FROM_PROTO: dict[int, Task] = {
    pb.POOLING_TASK_EMBED: Task.EMBED,
    pb.POOLING_TASK_CLASSIFY: Task.CLASSIFY,
    pb.POOLING_TASK_SCORE: Task.SCORE,
    pb.POOLING_TASK_TOKEN_EMBED: Task.TOKEN_EMBED,
    pb.POOLING_TASK_TOKEN_CLASSIFY: Task.TOKEN_CLASSIFY,
    pb.POOLING_TASK_EMBED_SPARSE: Task.EMBED_SPARSE,
    pb.POOLING_TASK_EMBED_MULTI: Task.EMBED_MULTI,
    pb.POOLING_TASK_EMBED_OUTPUTS: Task.EMBED_OUTPUTS,
}
TASK_TO_PROTO = {task: value for value, task in TASK_FROM_PROTO.items()}
POOLING_TYPE_TO_PROTO = {
    PoolingType.MEAN: pb.POOLING_TYPE_MEAN,
    PoolingType.CLS: pb.POOLING_TYPE_CLS,
    PoolingType.LAST: pb.POOLING_TYPE_LAST,
    PoolingType.ALL: pb.POOLING_TYPE_ALL,
    PoolingType.SPLADE: pb.POOLING_TYPE_SPLADE,
}


MODALITY_TO_PROTO = {
    Modality.TEXT: pb.MODALITY_TEXT,
    Modality.IMAGE: pb.MODALITY_IMAGE,
    Modality.AUDIO: pb.MODALITY_AUDIO,
}


def items_from_proto(items: Iterable[pb.Item], path: str) -> tuple[Item, ...]:
    """Each Item as a text, an Image or an Audio clip. An Item with none set is refused by
    its field path (`path[n]`, ITEM_EMPTY): read as an empty text, it was embedded as one."""
    read: list[Item] = []
    for index, item in enumerate(items):
        case = item.WhichOneof("content")
        if case == "text":
            read.append(item.text)
        elif case == "image":
            read.append(Image(item.image.data, item.image.mime_type))
        elif case == "audio":
            read.append(Audio(item.audio.data, item.audio.mime_type))
        else:
            description = "the item sets none of text, image and audio; set one of them"
            raise PoolingError.invalid([FieldViolation(f"{path}[{index}]", description, EMPTY)])
    return tuple(read)


EMPTY = "ITEM_EMPTY"


ENCODING_FROM_PROTO: dict[int, OutputEncoding] = {
    pb.EMBEDDING_ENCODING_UNSPECIFIED: OutputEncoding.FLOAT,
    pb.EMBEDDING_ENCODING_FLOAT32: OutputEncoding.FLOAT32,
    pb.EMBEDDING_ENCODING_FLOAT16: OutputEncoding.FLOAT16,
    pb.EMBEDDING_ENCODING_BFLOAT16: OutputEncoding.BFLOAT16,
    pb.EMBEDDING_ENCODING_BINARY: OutputEncoding.BINARY,
    pb.EMBEDDING_ENCODING_UBINARY: OutputEncoding.UBINARY,
    pb.EMBEDDING_ENCODING_INT8: OutputEncoding.INT8,
    pb.EMBEDDING_ENCODING_UINT8: OutputEncoding.UINT8,
}
ENCODING_TO_PROTO = {encoding: value for value, encoding in ENCODING_FROM_PROTO.items()}


def params_from_proto(params: pb.PoolingParams) -> tuple[PoolingParams, Task | None]:
    """The params and the declared task (None when unspecified, or not a task: see
    `_refuse_unknown`)."""
    return (
        PoolingParams(
            use_activation=params.use_activation if params.HasField("use_activation") else None,
            dimensions=params.dimensions if params.HasField("dimensions") else None,
            truncate_prompt_tokens=(
                params.truncate_prompt_tokens if params.HasField("truncate_prompt_tokens") else None
            ),
            output_weights=_output_weights(params),
        ),
        TASK_FROM_PROTO.get(params.task),
    )


def adapter_from_proto(params: pb.PoolingParams) -> str | None:
    """params.adapter: the LoRA adapter by name; unset or empty, the one the model name
    names, if any (Engine._adapted)."""
    return params.adapter or None


def _output_weights(params: pb.PoolingParams) -> OutputWeights | None:
    if not params.HasField("output_weights"):
        return None
    weights = params.output_weights
    return OutputWeights(weights.dense, weights.sparse, weights.multi)


def _outputs(request: pb.PoolRequest) -> dict[str, object]:
    """embed_outputs' fields: the outputs asked for and the sparse output's shape (an
    embed_sparse request's shape; nothing for other cases)."""
    case = request.WhichOneof("input")
    if case == "embed_sparse":
        given = request.embed_sparse
        return {"sparse_top_k": given.top_k, "sparse_tokens": given.return_tokens}
    if case != "embed_outputs":
        return {}
    asked = request.embed_outputs
    return {
        "outputs": frozenset(o for o in Output if getattr(asked, o.value)),
        "sparse_top_k": asked.sparse_top_k,
        "sparse_tokens": asked.return_tokens,
    }


def _refuse_unknown(
    params: pb.PoolingParams, encoding: int | None = None, rule: int | None = None
) -> None:
    """An enum value this server does not know (a newer client's), refused in one place
    after the whole message is converted, so that conversion calls on the rules last,
    once at most."""
    if params.task != pb.POOLING_TASK_UNSPECIFIED and params.task not in TASK_FROM_PROTO:
        raise unknown_value("params.task", params.task)
    if encoding is not None and encoding not in ENCODING_FROM_PROTO:
        raise unknown_value("encoding", encoding)
    if rule is not None and rule not in CHUNK_RULE_FROM_PROTO:
        raise unknown_value("late_chunking.rule", rule)


def request_from_proto(request: pb.PoolRequest) -> PoolRequest:
    case = request.WhichOneof("input")
    params, declared = params_from_proto(request.params)
    task = Task(case) if case else None
    inputs: dict[str, object] = {}
    if task is Task.SCORE:
        score = request.score
        inputs = {"text_1": tuple(score.text_1), "text_2": tuple(score.text_2)}
        if score.items_1 or score.items_2:  # an image model's texts and images
            inputs["items_1"] = items_from_proto(score.items_1, "score.items_1")
            inputs["items_2"] = items_from_proto(score.items_2, "score.items_2")
    elif task is not None:
        given = getattr(request, case)
        inputs = {"texts": tuple(given.texts)}
        if isinstance(given, pb.TextInput):
            inputs.update(_image_inputs(given, case))
    pool = PoolRequest(
        task=task,
        params=params,
        request_id=request.request_id,
        model=request.model,
        declared_task=declared,
        encoding=ENCODING_FROM_PROTO.get(request.encoding, OutputEncoding.FLOAT),
        prompt_name=request.prompt_name if request.HasField("prompt_name") else None,
        prompt=request.prompt if request.HasField("prompt") else None,
        late_chunking=_late_chunking(request),
        bypass_cache=request.params.bypass_cache,
        adapter=adapter_from_proto(request.params),
        **_outputs(request),
        **inputs,
    )
    rule = request.late_chunking.rule if request.HasField("late_chunking") else None
    _refuse_unknown(request.params, request.encoding, rule)
    return pool


def _image_inputs(given: pb.TextInput, case: str) -> dict[str, object]:
    """TextInput's image-model fields, where set: items, zero-shot labels and template.
    `case`: the request's input field (embed, classify), which paths name."""
    inputs: dict[str, object] = {}
    if given.items:
        inputs["items"] = items_from_proto(given.items, f"{case}.items")
    if given.candidate_labels:
        inputs["candidate_labels"] = tuple(given.candidate_labels)
    if given.HasField("label_template"):
        inputs["label_template"] = given.label_template
    return inputs


CHUNK_RULE_FROM_PROTO: dict[int, ChunkRule | None] = {
    pb.CHUNK_RULE_UNSPECIFIED: None,
    pb.CHUNK_RULE_SENTENCES: ChunkRule.SENTENCES,
    pb.CHUNK_RULE_TOKENS: ChunkRule.TOKENS,
}


def _late_chunking(request: pb.PoolRequest) -> LateChunking | None:
    if not request.HasField("late_chunking"):
        return None
    chunking = request.late_chunking
    return LateChunking(
        spans=tuple((span.start, span.end) for span in chunking.spans),
        rule=CHUNK_RULE_FROM_PROTO.get(chunking.rule),  # an unknown one: `_refuse_unknown`
        window=chunking.window_tokens,
        overlap=chunking.overlap_tokens,
    )


def rerank_request_from_proto(request: pb.RerankRequest) -> RerankRequest:
    params, declared = params_from_proto(request.params)
    rerank = RerankRequest(
        query=request.query,
        documents=tuple(request.documents),
        params=params,
        request_id=request.request_id,
        model=request.model,
        declared_task=declared,
        top_n=request.top_n,
        instruction=request.instruction if request.HasField("instruction") else None,
        items=items_from_proto(request.items, "items"),
        bypass_cache=request.params.bypass_cache,
        adapter=adapter_from_proto(request.params),
    )
    _refuse_unknown(request.params)
    return rerank


def rerank_response_to_proto(result: RerankResult, request: pb.RerankRequest) -> pb.RerankResponse:
    response = pb.RerankResponse(
        request_id=result.request_id,
        model=result.model,
        usage=_usage(result),
    )
    results = response.results
    for ranked in result.ranking:
        item = results.add(index=ranked.index, relevance_score=ranked.score)
        if ranked.modality is not None:  # the request's items: texts, images, audio clips
            item.modality = MODALITY_TO_PROTO[ranked.modality]
            given = request.items[ranked.index]
            if request.return_documents and given.WhichOneof("content") == "text":
                item.document = given.text
        elif request.return_documents:
            item.document = request.documents[ranked.index]
    return response


def _packed_floats(field_number: int, values: np.ndarray) -> bytes:
    """A packed `repeated float` field as wire bytes, straight from a float32 array.

    Merging these bytes into a message costs the same for 32 or 4,096 floats, where
    `tolist()` and `extend` build and convert one Python float per value.
    """
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return varint((field_number << 3) | 2) + varint(len(raw)) + raw


def _token_matrix(rows: TokenRows) -> pb.TokenMatrix:
    """A TokenMatrix whose per-token fields (ids, spans, special flags, label ids) are laid
    out as wire bytes from arrays and merged in: no TokenSpan object per token."""
    values = rows.values.reshape(len(rows.token_ids), -1)
    matrix = pb.TokenMatrix(rows=values.shape[0], cols=values.shape[1], labels=rows.labels)
    offsets = np.asarray(rows.offsets, dtype=np.int64).reshape(-1, 2)
    fields = [
        _packed_varints(4, np.asarray(rows.token_ids, dtype=np.int64)),
        _spans(5, offsets).build(),
        _packed_varints(6, np.asarray(rows.special_tokens_mask, dtype=np.int64)),
        _packed_varints(7, np.asarray(rows.label_ids, dtype=np.int64)),
    ]
    if rows.encoding is OutputEncoding.FLOAT:
        fields.append(_packed_floats(3, values))
    else:
        matrix.data = rows.data
        matrix.encoding = ENCODING_TO_PROTO[rows.encoding]
    matrix.MergeFromString(b"".join(fields))
    return matrix


def _packed_varints(field_number: int, values: np.ndarray) -> bytes:
    """A packed repeated integer field (non-negative values) as wire bytes; none when empty."""
    if not len(values):
        return b""
    payload = Layout(len(values)).varints(values).build()
    return varint((field_number << 3) | 2) + varint(len(payload)) + payload


def _spans(field_number: int, offsets: np.ndarray, layout: Layout | None = None) -> Layout:
    """A repeated TokenSpan field, one entry per row of `offsets` ([start, end)), added to
    `layout` (a new one by default)."""
    start, end = offsets[:, 0], offsets[:, 1]
    has_start, has_end = start != 0, end != 0  # proto3 leaves a zero out
    size = (varint_lengths(start) + 1) * has_start + (varint_lengths(end) + 1) * has_end
    layout = layout if layout is not None else Layout(len(offsets))
    return (
        layout.fixed(varint((field_number << 3) | 2))
        .varints(size)
        .fixed(b"\x08", has_start)
        .varints(start, has_start)
        .fixed(b"\x10", has_end)
        .varints(end, has_end)
    )


def _embedding(target: pb.Embedding, o: Embedding) -> None:
    """Fill `target` with one vector: packed floats, or the request's encoding."""
    if o.encoding is OutputEncoding.FLOAT:
        target.MergeFromString(_packed_floats(1, o.values))
    else:
        target.data = o.data
        target.dimensions = o.values.shape[-1]
        target.encoding = ENCODING_TO_PROTO[o.encoding]
    if o.modality is not None:
        target.modality = MODALITY_TO_PROTO[o.modality]


def _usage(result: PoolResult | RerankResult) -> pb.Usage:
    tokens = result.prompt_tokens
    return pb.Usage(prompt_tokens=tokens, total_tokens=tokens, cached_tokens=result.cached_tokens)


def response_to_proto(result: PoolResult) -> pb.PoolResponse:
    response = pb.PoolResponse(
        request_id=result.request_id,
        model=result.model,
        usage=_usage(result),
    )
    outputs = result.outputs
    if result.task is Task.EMBED:
        embeddings = response.embed.embeddings
        for o in outputs:
            if isinstance(o, Embedding):
                _embedding(embeddings.add(), o)
            elif isinstance(o, LateChunks):
                chunks = response.embed.chunked.add().chunks
                for (start, end), embedding in zip(o.spans, o.embeddings, strict=True):
                    chunk = chunks.add(span=pb.TokenSpan(start=start, end=end))
                    _embedding(chunk.embedding, embedding)
    elif result.task is Task.CLASSIFY:
        classifications = response.classify.classifications
        for o in outputs:
            if isinstance(o, Classification):
                item = classifications.add(label_id=o.label_id, label=o.label)
                item.MergeFromString(_packed_floats(1, o.probs))
                if o.modality is not None:
                    item.modality = MODALITY_TO_PROTO[o.modality]
    elif result.task is Task.SCORE:
        response.score.scores.extend(o.value for o in outputs if isinstance(o, Score))
    elif result.task is Task.EMBED_MULTI:
        response.embed_multi.items.extend(
            _multi_vector(o) for o in outputs if isinstance(o, MultiVector)
        )
    elif result.task is Task.EMBED_SPARSE:
        sparse = response.embed_sparse.embeddings
        for o in outputs:
            if isinstance(o, SparseEmbedding):
                _sparse(sparse.add(), o)
    elif result.task is Task.EMBED_OUTPUTS:
        items = response.embed_outputs.items
        for o in outputs:
            if isinstance(o, TextOutputs):
                _text_outputs(items.add(), o)
    else:
        target = (
            response.token_embed if result.task is Task.TOKEN_EMBED else response.token_classify
        )
        target.items.extend(_token_matrix(o) for o in outputs if isinstance(o, TokenRows))
    return response


def _sparse(target: pb.SparseEmbedding, o: SparseEmbedding) -> None:
    target.indices.extend(o.indices.tolist())
    target.tokens.extend(o.tokens)
    target.MergeFromString(_packed_floats(2, o.values))


def _text_outputs(target: pb.TextOutputs, o: TextOutputs) -> None:
    """One text's outputs of a multi-output model: those it asked for, the others unset."""
    if o.dense is not None:
        _embedding(target.dense, o.dense)
    if o.sparse is not None:
        _sparse(target.sparse, o.sparse)
    if o.multi is not None:
        target.multi.CopyFrom(_multi_vector(o.multi))


def _multi_vector(matrix: MultiVector) -> pb.MultiVectorMatrix:
    """Always bytes: float32 (little-endian) where the request named no encoding."""
    rows, cols = matrix.values.shape
    if matrix.encoding is OutputEncoding.FLOAT:
        data = matrix.values.astype("<f4", copy=False).tobytes()
        encoding = pb.EMBEDDING_ENCODING_FLOAT32
    else:
        data, encoding = matrix.data, ENCODING_TO_PROTO[matrix.encoding]
    return pb.MultiVectorMatrix(rows=rows, cols=cols, data=data, encoding=encoding)


def _multi_vector_settings(info: ModelInfo) -> pb.MultiVectorSettings | None:
    settings = info.settings
    if not isinstance(settings, MultiVectorSettings):
        return None
    return pb.MultiVectorSettings(
        query_prefix=settings.query_prefix,
        document_prefix=settings.document_prefix,
        query_length=settings.query_length or 0,
        document_length=settings.document_length or 0,
        query_expansion=settings.query_expansion,
        attend_to_expansion_tokens=settings.attend_to_expansion,
        skiplist_words=settings.skiplist_words,
    )


def model_card(info: ModelInfo) -> pb.ModelCard:
    return pb.ModelCard(
        name=info.name,
        tasks=[TASK_TO_PROTO[task] for task in info.tasks],
        hidden_size=info.hidden_size,
        max_input_tokens=info.max_input_tokens,
        is_matryoshka=info.is_matryoshka,
        matryoshka_dimensions=info.matryoshka_dimensions,
        labels=info.labels,
        pooling_type=POOLING_TYPE_TO_PROTO[info.pooling_type],
        default_use_activation=info.default_normalize,
        is_default=info.is_default,
        architecture=info.architecture,
        truncation_side=info.truncation_side,
        long_input=str(info.long_input),
        has_calibration_ranges=info.calibration_ranges is not None,
        prompts=info.prompts,
        default_prompt_name=info.default_prompt_name or "",
        dtype=info.dtype,
        device=info.device,
        revision=info.revision,
        backend=info.backend,
        precision=info.precision,
        backend_file=info.backend_file,
        engines_per_device=info.engines_per_device,
        calibration_source=info.calibration_source,
        score_template_source=info.score_template_source,
        multi_vector=_multi_vector_settings(info),
        outputs=info.outputs,
        modalities=[MODALITY_TO_PROTO[Modality(m)] for m in info.modalities],
        image_size=info.settings.image_size[0] if info.accepts_media else 0,
    )


def tokenize_response(tokenized: Tokenized, budget: ResponseBudget) -> bytes:
    """A TokenizeResponse's wire bytes, laid out from the token arrays (service/byte_layout.py)
    rather than a message per token; its exact size is checked against `budget` first.

    Each TokenizedText holds its ids packed, then per token its string (`tokens`) and its
    span (`offsets`) side by side: repeated fields may interleave on the wire, and a parser
    reads the same lists as from protobuf's own field-by-field order. A long text is laid
    out TOKEN_BLOCK tokens at a time, which bounds the arrays the layout needs."""
    info = tokenized.info
    model = info.name.encode()
    head = b"\n" + varint(len(model)) + model
    tail = b"\x18" + varint(info.max_input_tokens) if info.max_input_tokens else b""
    sizes = [_item_sizes(item, tokenized) for item in tokenized.items]
    size = len(head) + len(tail) + sum(1 + len(varint(body)) + body for _, body in sizes)
    if size > budget.max_bytes:
        raise output_too_large("texts", size, budget)
    out = [head]
    for item, (payload, body) in zip(tokenized.items, sizes, strict=True):
        out.append(b"\x12" + varint(body))
        if payload:
            out.append(b"\n" + varint(payload))
            out += (ids.build() for ids, _ in _token_blocks(item, tokenized))
        out += (rows.build() for _, rows in _token_blocks(item, tokenized))
    out.append(tail)
    return b"".join(out)


TOKEN_BLOCK = 16384


def _item_sizes(item: TokenizedText, tokenized: Tokenized) -> tuple[int, int]:
    """The packed ids' payload and the whole TokenizedText message, in bytes."""
    payload = rows = 0
    for ids, block in _token_blocks(item, tokenized):
        payload += ids.size()
        rows += block.size()
    return payload, (1 + len(varint(payload)) + payload if payload else 0) + rows


def _token_blocks(item: TokenizedText, tokenized: Tokenized) -> Iterator[tuple[Layout, Layout]]:
    """One text's packed ids (field 1's payload), and its tokens (2) and offsets (3), a
    block of tokens at a time."""
    vocabulary = tokenized.vocabulary
    for first in range(0, len(item), TOKEN_BLOCK):
        ids = item.token_ids[first : first + TOKEN_BLOCK]
        inside = (ids >= 0) & (ids < len(vocabulary.lengths))
        known = np.where(inside, ids, 0)
        lengths = np.where(inside, vocabulary.lengths[known], 0)
        strings = (
            Layout(len(ids))
            .fixed(b"\x12")
            .varints(lengths)
            .spans(vocabulary.utf8, vocabulary.starts[known], lengths)
        )
        rows = _spans(3, item.offsets[first : first + TOKEN_BLOCK], strings)
        yield Layout(len(ids)).varints(ids), rows
