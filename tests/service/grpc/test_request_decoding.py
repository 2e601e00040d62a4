"""Decoding requests with bounded work, without a server: the HTTP body decoder
(service/http/json_body.py), the gRPC wire count (service/grpc/wire_count.py) and refusals that
hold no reference to their request (no traceback cycles)."""

from __future__ import annotations

import gc
import json
import time
import weakref
from collections.abc import Callable, Iterator

import msgspec
import pytest

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request, validate_rerank
from pooling_server.service.grpc.handlers import Malformed, tolerant
from pooling_server.service.grpc.wire_count import PRECOUNT_BYTES, SPECS, list_over_limit
from pooling_server.service.http.bodies import EmbeddingsBody, RerankBody
from pooling_server.service.http.json_body import (
    MAX_DEPTH,
    BodyError,
    count_entries,
    decode,
    structure,
)
from pooling_server.service.proto import pooling_pb2 as pb
from tests.model_infos import embedder_info

LIMIT = 1024
MODEL = embedder_info(name="embedder", tasks=(Task.EMBED, Task.SCORE))
MANY = 4_200_000  # two-character texts: a 16 MB body


def _texts(raw: bytes, field: str = "input") -> list[str]:
    """`field` of `raw` as texts, decoded as the route that reads it decodes its body."""
    kind = RerankBody if field == "documents" else EmbeddingsBody
    return getattr(decode(raw, kind, LIMIT), field).texts(field)  # type: ignore[no-any-return]


def _refusal(raw: bytes, field: str = "input") -> tuple[str, str, str]:
    """(kind, reason, field) of how reading `field` of `raw` fails."""
    try:
        _texts(raw, field)
    except PoolingError as error:  # INVALID_BODY is OpenAI's 422 in the errors table
        status = "422" if error.reason == "INVALID_BODY" else "400"
        return status, error.reason, error.violations[0].field if error.violations else ""
    raise AssertionError("accepted")


# ------------------------------------------------------------------------ JSON bodies


def test_structure_sees_through_strings_and_escapes() -> None:
    texts = ['a\\",[{', "[[[", '\\\\"', "]}]},,,"]
    assert structure(json.dumps(texts).encode()) == (1, 4)
    assert structure(json.dumps({"x": [[1, 2], {"y": [3]}]}).encode()) == (4, 1)
    nested = b"[" * 40 + b"]" * 40
    assert structure(nested)[0] == 40


@pytest.mark.parametrize(
    "entries",
    [
        ["ab"] * 5000,  # flat and unescaped: counted by its quotes
        ['a\\"b', "c,d"] * 2500,  # escapes: counted by the structure scan
        [{"text": "a,b"}, "c"] * 2500,  # objects: by the structure scan
    ],
)
def test_count_entries_reads_a_field_in_place(entries: list[object]) -> None:
    """A list field is counted on the body's own bytes (msgspec.Raw, a view of a
    bytearray as the HTTP guard reads it), however its entries are written."""
    body = bytearray(json.dumps({"input": entries}).encode())
    raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])["input"]
    assert count_entries(raw) == count_entries(bytes(raw)) == len(entries)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_deep_nesting_is_malformed(depth: int) -> None:
    body = b'{"input": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(PoolingError) as caught:
        decode(body, EmbeddingsBody, LIMIT)
    assert caught.value.reason == "MALFORMED_REQUEST"
    assert f"more than {MAX_DEPTH}" in caught.value.message


def test_brackets_inside_texts_are_not_nesting() -> None:
    texts = ["[" * 200, "{" * 200 + '\\"' * 10]
    assert _texts(json.dumps({"input": texts}).encode()) == texts


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (b'"ab"', "TOO_MANY_INPUTS"),
        (b"[]", "TOO_MANY_INPUTS"),
        (b"{}", "TOO_MANY_INPUTS"),
        (b'"\\\\"', "TOO_MANY_INPUTS"),
        (b"1", "TOKEN_INPUT_NOT_SUPPORTED"),  # the typed decoder stops at the first
    ],
)
def test_millions_of_entries_are_counted_not_built(item: bytes, reason: str) -> None:
    body = b'{"input": [' + b",".join([item] * MANY) + b"]}"
    started = time.monotonic()
    assert _refusal(body) == ("400", reason, "input")
    assert time.monotonic() - started < 2.0  # about 0.2 s; no list of millions is built


def test_many_documents_are_counted() -> None:
    body = b'{"query": "q", "documents": [' + b",".join([b'{"text": "a"}'] * 100_000) + b"]}"
    assert _refusal(body, "documents") == ("400", "TOO_MANY_INPUTS", "documents")
    body = b'{"documents": ["a", {"text": 1}]}'
    assert _refusal(body, "documents") == ("422", "INVALID_BODY", "documents[1]")


def test_a_list_within_the_limit_is_decoded() -> None:
    texts = ["x" * 100] * LIMIT
    assert _texts(json.dumps({"input": texts}).encode()) == texts


def test_wrong_types_stop_at_the_first_wrong_value() -> None:
    assert _refusal(b'{"input": 5}') == ("422", "INVALID_BODY", "input")
    assert _refusal(b'{"input": [1, 2]}')[1] == "TOKEN_INPUT_NOT_SUPPORTED"
    assert _refusal(b"[1]", "input") == ("422", "INVALID_BODY", "body")
    assert _refusal(b'{"input": ') == ("400", "MALFORMED_REQUEST", "")


@pytest.mark.parametrize(
    ("value", "outcome"),
    [
        ("1000000000000", "VALUE_OUT_OF_RANGE"),
        ("1000000000000000000", "VALUE_OUT_OF_RANGE"),
        ("-1000000000000000000000", "VALUE_OUT_OF_RANGE"),
        ("2147483648", "VALUE_OUT_OF_RANGE"),
        ("2.5", "INVALID_BODY"),
        ("1e3", "INVALID_BODY"),
        ("true", "INVALID_BODY"),
        ('"5"', "INVALID_BODY"),
        ("2147483647", None),
        ("-2147483648", None),
        ("null", None),
    ],
)
@pytest.mark.parametrize("field", ["dimensions", "top_n", "truncate_prompt_tokens"])
def test_integers_fit_the_wire_type(field: str, value: str, outcome: str | None) -> None:
    kind = RerankBody if field == "top_n" else EmbeddingsBody
    body = f'{{"{field}": {value}, "input": "x", "documents": "d"}}'.encode()
    try:
        decode(body, kind, LIMIT)
    except BodyError as error:  # a PoolingError too: the more specific first
        assert (error.violation.reason, error.violation.field) == (outcome, field)
        return
    except PoolingError as error:
        assert error.reason == outcome
        assert error.violations[0].field == field
        assert "from -2147483648 to 2147483647" in error.message
        return
    assert outcome is None


# ------------------------------------------------------------------- gRPC messages


def _messages() -> Iterator[tuple[type, object, str]]:
    texts = ["ab"] * 100_000
    yield pb.PoolRequest, pb.PoolRequest(embed=pb.TextInput(texts=texts)), "embed.texts"
    score = pb.ScoreInput(text_1=["q"], text_2=texts)
    yield pb.PoolRequest, pb.PoolRequest(score=score), "score.text_2"
    inner = pb.PoolRequest(request_id="r", token_classify=pb.TextInput(texts=texts))
    stream = pb.PoolStreamRequest(request=inner)
    yield pb.PoolStreamRequest, stream, "request.token_classify.texts"
    yield pb.RerankRequest, pb.RerankRequest(query="q", documents=texts), "documents"
    yield pb.TokenizeRequest, pb.TokenizeRequest(texts=texts), "texts"


@pytest.mark.parametrize(("cls", "message", "path"), list(_messages()))
def test_lists_are_counted_on_the_wire(cls: type, message: object, path: str) -> None:
    data = message.SerializeToString()  # type: ignore[attr-defined]
    started = time.monotonic()
    refused = tolerant(cls, lambda: LIMIT)(data)
    assert time.monotonic() - started < 0.1  # protobuf would take 10 ms and build 100k
    assert isinstance(refused, Malformed) and refused.path == path
    error = refused.error("messages[3]")
    assert (error.reason, error.violations[0].field) == ("TOO_MANY_INPUTS", f"messages[3].{path}")
    assert f"more than {LIMIT} inputs" in error.message


def test_a_refused_stream_message_keeps_its_request_id() -> None:
    texts = pb.TextInput(texts=["ab"] * 100_000)
    for request in (
        pb.PoolRequest(request_id="big", embed=texts),
        pb.PoolRequest(embed=texts, request_id="big"),
    ):
        data = pb.PoolStreamRequest(request=request).SerializeToString()
        refused = tolerant(pb.PoolStreamRequest, lambda: LIMIT)(data)
        assert isinstance(refused, Malformed) and refused.request_id == "big"


def test_split_lists_are_counted_together() -> None:
    """Protobuf merges repeated occurrences of a submessage: so does the count."""
    part = pb.PoolRequest(embed=pb.TextInput(texts=["a" * 60] * 600)).SerializeToString()
    assert list_over_limit(part, SPECS["PoolRequest"], LIMIT) is None
    assert list_over_limit(part * 2, SPECS["PoolRequest"], LIMIT) == "embed.texts"


def test_legal_and_unreadable_messages_go_to_protobuf() -> None:
    legal = pb.PoolRequest(embed=pb.TextInput(texts=["a" * 1000] * LIMIT), model="m")
    assert isinstance(
        tolerant(pb.PoolRequest, lambda: LIMIT)(legal.SerializeToString()), pb.PoolRequest
    )
    garbage = b"\xff" * PRECOUNT_BYTES
    assert tolerant(pb.PoolRequest, lambda: LIMIT)(garbage).reason == "MALFORMED_REQUEST"  # type: ignore[union-attr]
    many_fields = pb.PoolRequest(model="m").SerializeToString() * 50_000  # no inputs at all
    assert list_over_limit(many_fields, SPECS["PoolRequest"], LIMIT) is None


# -------------------------------------------------------------- refusals hold nothing


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_refused_request_is_freed_without_the_collector(no_gc: None) -> None:
    """With the collector off, only reference counting frees: a traceback cycle through
    the validating frame would keep the request (and its texts) alive."""
    refused: list[Callable[[], PoolRequest]] = [
        lambda: PoolRequest(task=Task.EMBED, texts=("a",) * (LIMIT + 1)),  # TOO_MANY_INPUTS
        lambda: PoolRequest(task=Task.EMBED, texts=("a",), params=PoolingParams(dimensions=10**9)),
        lambda: PoolRequest(task=Task.CLASSIFY, texts=("a",)),  # FAILED_PRECONDITION stage
    ]
    limits = Limits(max_client_batch_size=LIMIT)
    for make in refused:
        request = make()
        alive = weakref.ref(request)
        assert _refuses(validate_request, request, limits)
        del request
        assert alive() is None
    rerank = RerankRequest(query="q", documents=("d",) * (LIMIT + 1))
    alive_rerank = weakref.ref(rerank)
    assert _refuses(validate_rerank, rerank, limits)
    del rerank
    assert alive_rerank() is None


def _refuses(validate: Callable[..., None], request: object, limits: Limits) -> bool:
    """Whether `validate` refuses `request`; the error is dropped here, as a door drops it
    once answered (pytest.raises would keep it)."""
    try:
        validate(request, MODEL, limits)
    except PoolingError:
        return True
    return False
