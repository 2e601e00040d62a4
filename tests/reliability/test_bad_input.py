"""Hostile and random input: every answer is a success of the right shape or a documented error.

The property tests send hypothesis-built PoolRequests (any input case or none, texts with
control characters, RTL marks, NULs and up to ~50k characters, parameters with negative and
huge int32 values, unknown task numbers, served and garbage model names) to the shared
server and run the same requests through the validator in-process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.models.loader import LoadedModel, ModelSpec, load_model
from pooling_server.engine.models.model_info import LongInput
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request
from pooling_server.service.grpc.convert import request_from_proto
from tests.conftest import DEFAULT_MODEL, MAX_CLIENT_BATCH_SIZE
from tests.reliability.support import (
    CLIENT_ERROR_CODES,
    assert_alive,
    check_rpc_error,
    check_status,
    check_success,
    embed_request,
    report,
)
from tests.server_process import ServerProcess

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SPECIALS = [
    "\x00",
    "\x01",
    "\x1b",
    "\x7f",
    "\n",
    "\r\n",
    "\t",
    "\u200f",  # right-to-left mark
    "\u202e",  # right-to-left override
    "\u200b",  # zero-width space
    "\ufeff",
    "\ufffd",
    "e\u0301",
    "\U0001f642",
    "\U0010ffff",
    "שלום",
    "مرحبا",
    "[CLS]",
    "[SEP]",
    "[PAD]",
    "##",
]
CASES = [None, "embed", "classify", "score", "token_embed", "token_classify"]
RPC_TIMEOUT = 60.0


def examples(count: int) -> int:
    """RELIABILITY_SCALE=10 runs ten times the examples, for a longer hunt."""
    return max(1, int(count * float(os.environ.get("RELIABILITY_SCALE", "1"))))


def hunting(count: int) -> settings:
    """Hypothesis' settings for a hunt of `count` examples (scaled): no deadline and no
    example database (every run hunts afresh), large and slow examples allowed."""
    return settings(
        max_examples=examples(count),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Single characters and multi-character specials (combining marks, words, marker tokens).
fragments = st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPECIALS))


def strings(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[str]:
    return st.lists(fragments, min_size=min_size, max_size=max_size).map("".join)


short_texts = strings()


def _huge(base: str, size: int) -> str:
    return ((base + " ") * (size // (len(base) + 1) + 1))[:size]


huge_texts = st.builds(_huge, strings(1, 12), st.integers(1_000, 50_000))
texts = st.one_of(*[short_texts] * 6, st.just(""), huge_texts)
# Mostly a few texts; sometimes just around the batch limit of the shared server.
text_lists = st.one_of(
    st.lists(texts, max_size=6),
    st.lists(short_texts, min_size=MAX_CLIENT_BATCH_SIZE - 1, max_size=MAX_CLIENT_BATCH_SIZE + 2),
)
int32s = st.one_of(
    st.integers(INT32_MIN, INT32_MAX),
    st.sampled_from([INT32_MIN, -2, -1, 0, 1, 2, 3, 8, 31, 32, 33, 128, 129, 256, 257, 384, 385]),
)
# Mostly unset or a known task, sometimes any int32 (unknown enum numbers stay on the wire).
tasks = st.one_of(
    st.just(0), st.integers(0, 5), st.integers(0, 6), st.integers(INT32_MIN, INT32_MAX)
)


@st.composite
def pooling_params(draw: st.DrawFn) -> pb.PoolingParams:
    params = pb.PoolingParams(task=draw(tasks))
    if draw(st.booleans()):
        params.use_activation = draw(st.booleans())
    if not draw(st.integers(0, 2)):
        params.dimensions = draw(int32s)
    if not draw(st.integers(0, 2)):
        params.truncate_prompt_tokens = draw(int32s)
    return params


@st.composite
def hostile_requests(draw: st.DrawFn, models: list[str]) -> pb.PoolRequest:
    """Anything: any input case or none, any model name, any params."""
    request = pb.PoolRequest(
        request_id=draw(strings(max_size=20)),
        model=draw(st.sampled_from(models)) if draw(st.integers(0, 3)) else draw(strings(0, 30)),
    )
    if draw(st.booleans()):
        request.params.CopyFrom(draw(pooling_params()))
    case = draw(st.sampled_from(CASES[1:])) if draw(st.integers(0, 7)) else None
    _fill(draw, request, case)
    return request


@st.composite
def plausible_requests(draw: st.DrawFn, tasks_by_model: dict[str, list[str]]) -> pb.PoolRequest:
    """A served model with a task it supports, so odd texts and params reach the model."""
    model = draw(st.sampled_from(sorted(tasks_by_model)))
    case = draw(st.sampled_from(tasks_by_model[model]))
    request = pb.PoolRequest(request_id=draw(strings(max_size=20)), model=model)
    if draw(st.booleans()):
        request.params.use_activation = draw(st.booleans())
    if not draw(st.integers(0, 3)):
        request.params.dimensions = draw(int32s)
    if not draw(st.integers(0, 2)):
        request.params.truncate_prompt_tokens = draw(st.one_of(st.just(-1), int32s))
    _fill(draw, request, case, st.lists(texts, min_size=1, max_size=4))
    return request


def _fill(
    draw: st.DrawFn,
    request: pb.PoolRequest,
    case: str | None,
    lists: st.SearchStrategy[list[str]] = text_lists,
) -> None:
    if case == "score":
        request.score.text_1.extend(draw(lists))
        request.score.text_2.extend(draw(lists))
    elif case is not None:
        getattr(request, case).texts.extend(draw(lists))


def any_requests(tasks_by_model: dict[str, list[str]]) -> st.SearchStrategy[pb.PoolRequest]:
    return st.one_of(hostile_requests(["", *tasks_by_model]), plausible_requests(tasks_by_model))


@pytest.fixture(scope="module")
def tasks_by_model(stub: pooling_pb2_grpc.PoolingServiceStub) -> dict[str, list[str]]:
    """Served model -> the input cases it supports, as ListModels reports them."""
    listed = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    return {
        card.name: [
            pb.PoolingTask.Name(t).removeprefix("POOLING_TASK_").lower() for t in card.tasks
        ]
        for card in listed.models
    }


# --------------------------------------------------------------------------- live server


def test_random_requests_get_a_result_or_a_documented_error(
    server: ServerProcess,
    stub: pooling_pb2_grpc.PoolingServiceStub,
    tasks_by_model: dict[str, list[str]],
    record_property,
) -> None:
    outcomes: dict[str, int] = {}
    started = time.monotonic()

    @hunting(600)
    @given(request=any_requests(tasks_by_model))
    def check(request: pb.PoolRequest) -> None:
        try:
            response = stub.Pool(request, timeout=RPC_TIMEOUT)
        except grpc.RpcError as error:
            decoded = check_rpc_error(error, CLIENT_ERROR_CODES)
            key = f"{decoded.code.name}/{decoded.reason}"
        else:
            check_success(request, response)
            key = "OK"
        outcomes[key] = outcomes.get(key, 0) + 1

    check()
    assert_alive(server)
    report(
        record_property,
        "bad_input_unary",
        requests=sum(outcomes.values()),
        seconds=time.monotonic() - started,
        outcomes=outcomes,
    )
    assert outcomes.get("OK", 0) > 0, "the strategy never produced a valid request"


def test_random_requests_on_a_stream(
    server: ServerProcess,
    stub: pooling_pb2_grpc.PoolingServiceStub,
    tasks_by_model: dict[str, list[str]],
    record_property,
) -> None:
    """The same requests over PoolStream: each id answered once, errors in-band and documented."""
    counts = {"streams": 0, "items": 0, "errors": 0}

    @hunting(50)
    @given(requests=st.lists(any_requests(tasks_by_model), min_size=1, max_size=8))
    def check(requests: list[pb.PoolRequest]) -> None:
        for i, request in enumerate(requests):
            request.request_id = f"r{i}"
        by_id = {r.request_id: r for r in requests}
        answered: list[str] = []
        messages = (pb.PoolStreamRequest(request=r) for r in requests)
        for message in stub.PoolStream(messages, timeout=RPC_TIMEOUT):
            answered.append(message.request_id)
            if message.WhichOneof("result") == "error":
                check_status(message.error, CLIENT_ERROR_CODES)
                counts["errors"] += 1
            else:
                check_success(by_id[message.request_id], message.response)
        assert sorted(answered) == sorted(by_id)
        counts["streams"] += 1
        counts["items"] += len(requests)

    check()
    assert_alive(server)
    report(record_property, "bad_input_stream", **counts)


def test_random_bytes_get_a_documented_answer(server: ServerProcess) -> None:
    """Random bytes may even parse as a request; whatever happens, no INTERNAL or UNKNOWN."""
    channel = grpc.insecure_channel(server.address)
    call = channel.unary_unary("/pooling.v1.PoolingService/Pool")

    @settings(max_examples=examples(200), deadline=None, database=None)
    @given(payload=st.binary(max_size=300))
    def check(payload: bytes) -> None:
        try:
            answer = call(payload, timeout=RPC_TIMEOUT)
        except grpc.RpcError as error:
            check_rpc_error(error, CLIENT_ERROR_CODES)
        else:
            assert isinstance(answer, bytes)
            pb.PoolResponse.FromString(answer)

    try:
        check()
    finally:
        channel.close()
    assert_alive(server)


def test_random_tokenize_requests(
    server: ServerProcess,
    stub: pooling_pb2_grpc.PoolingServiceStub,
    tasks_by_model: dict[str, list[str]],
) -> None:
    models = ["", *tasks_by_model]

    @hunting(200)
    @given(
        model=st.one_of(st.sampled_from(models), strings(0, 30)),
        texts=text_lists,
        special=st.one_of(st.none(), st.booleans()),
    )
    def check(model: str, texts: list[str], special: bool | None) -> None:
        request = pb.TokenizeRequest(model=model, texts=texts)
        if special is not None:
            request.add_special_tokens = special
        try:
            response = stub.Tokenize(request, timeout=RPC_TIMEOUT)
        except grpc.RpcError as error:
            check_rpc_error(error, CLIENT_ERROR_CODES)
            return
        assert len(response.items) == len(texts)
        assert response.max_input_tokens > 0
        for text, item in zip(texts, response.items, strict=True):
            assert len(item.token_ids) == len(item.tokens) == len(item.offsets)
            for span in item.offsets:
                assert 0 <= span.start <= span.end <= len(text), (span, len(text))

    check()
    assert_alive(server)


# --------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def loaded_models(model_folders: dict[str, Path]) -> Iterator[list[LoadedModel]]:
    """The default model and tiny models with the other heads and long-input modes."""
    specs = [
        ModelSpec(DEFAULT_MODEL, name=DEFAULT_MODEL),
        ModelSpec(str(model_folders["tiny-cross-encoder"]), name="tiny-cross-encoder"),
        ModelSpec(str(model_folders["tiny-ner"]), name="tiny-ner", long_input=LongInput.CHUNK),
        ModelSpec(
            str(model_folders["tiny-bert"]),
            name="tiny-bert-chunk",
            long_input=LongInput.CHUNK,
            hf_overrides={"matryoshka_dimensions": [8, 16]},
        ),
    ]
    device = torch.device("cpu")
    yield [load_model(spec, device=device, dtype=torch.float32) for spec in specs]


def test_validator_only_raises_pooling_error(
    loaded_models: list[LoadedModel], record_property
) -> None:
    """request_from_proto, validate_request and planning (tokenize, length checks) in-process."""
    limits = Limits(max_client_batch_size=MAX_CLIENT_BATCH_SIZE)
    outcomes: dict[str, int] = {}
    by_name = {model.info.name: model for model in loaded_models}
    tasks = {name: [str(t) for t in model.info.tasks] for name, model in by_name.items()}

    @hunting(400)
    @given(request=any_requests(tasks))
    def check(request: pb.PoolRequest) -> None:
        model = by_name.get(request.model, loaded_models[0])
        try:
            converted = request_from_proto(request)
            validate_request(converted, model.info, limits)
            plan = plan_request(converted, model)
        except PoolingError as error:
            assert error.reason and error.message
            key = error.reason
        else:
            assert plan.work, "a valid request must queue at least one sequence"
            key = "VALID"
        outcomes[key] = outcomes.get(key, 0) + 1

    check()
    report(record_property, "bad_input_validator", requests=sum(outcomes.values()), **outcomes)


# --------------------------------------------------------------------------- specific cases


def test_hundred_thousand_tiny_texts(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """10^5 one-character texts (~300 kB, under the 64 MiB message limit): rejected quickly."""
    many = ["a"] * 100_000
    started = time.monotonic()
    requests = {
        "embed": embed_request(many),
        "score": pb.PoolRequest(score=pb.ScoreInput(text_1=["q"], text_2=many)),
        "token_classify": pb.PoolRequest(model="tiny-ner", token_classify=pb.TextInput(texts=many)),
    }
    for case, request in requests.items():
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(request, timeout=30)
        error = check_rpc_error(caught.value, [grpc.StatusCode.INVALID_ARGUMENT])
        assert error.reason == "TOO_MANY_INPUTS", case
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(pb.TokenizeRequest(texts=many), timeout=30)
    assert check_rpc_error(caught.value, [grpc.StatusCode.INVALID_ARGUMENT]).reason == (
        "TOO_MANY_INPUTS"
    )
    # On a stream the request weighs more than the whole in-flight capacity: still answered.
    answers = list(
        stub.PoolStream(
            iter([pb.PoolStreamRequest(request=embed_request(many, request_id="big"))]), timeout=30
        )
    )
    assert [a.request_id for a in answers] == ["big"]
    assert check_status(answers[0].error, [grpc.StatusCode.INVALID_ARGUMENT]).reason == (
        "TOO_MANY_INPUTS"
    )
    seconds = time.monotonic() - started
    report(record_property, "bad_input_100k_texts", calls=5, seconds=seconds)
    assert seconds < 30, f"rejecting 10^5 texts took {seconds:.1f}s"
    assert_alive(server)


def test_one_megabyte_text(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """A text past the character bound is refused before tokenizing, whatever the params;
    one just inside the long-text bound is truncated or chunked."""
    text = ("lorem ipsum dolor sit amet \u200f\x00 " * 40_000)[: 1 << 20]
    timings = {}
    for name, request in (
        ("reject", embed_request([text])),
        ("truncate", embed_request([text], truncate_prompt_tokens=-1)),
        ("chunk", embed_request([text], model="tiny-bert-chunk")),
    ):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(request, timeout=60)
        error = check_rpc_error(caught.value, [grpc.StatusCode.INVALID_ARGUMENT])
        assert (error.reason, error.fields) == ("INPUT_TOO_LONG", ["embed.texts[0]"])
        timings[f"{name}_refused_s"] = time.monotonic() - started

    fits = text[: 1024 * 256]  # the default model's long-text bound: 1024 per token of 256
    started = time.monotonic()
    response = stub.Pool(embed_request([fits], truncate_prompt_tokens=-1), timeout=60)
    check_success(embed_request([fits]), response)
    assert response.usage.prompt_tokens == 256  # the default model's maximum
    timings["truncate_s"] = time.monotonic() - started

    fits = text[: 1024 * 128]  # tiny-bert-chunk's maximum length is 128 tokens
    started = time.monotonic()
    response = stub.Pool(embed_request([fits], model="tiny-bert-chunk"), timeout=120)
    assert len(response.embed.embeddings) == 1
    assert response.usage.prompt_tokens > 20_000  # every token, over many chunks
    timings["chunk_s"] = time.monotonic() - started
    report(record_property, "bad_input_1mb_text", **timings)
    assert_alive(server)


def test_duplicate_and_missing_stream_ids(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    """The first use of an id is served. A repeat or a missing id is refused in-band with an
    empty request_id (so no answer ever carries an id twice); its field path names the
    message's 0-based index in the stream, and ErrorInfo metadata names a repeated id."""
    ids = ["a", "b", "a", "", "b", "c", "a"]
    messages = [
        pb.PoolStreamRequest(request=embed_request([f"text {i}"], request_id=rid))
        for i, rid in enumerate(ids)
    ]
    answers = list(stub.PoolStream(iter(messages), timeout=60))
    served = sorted(a.request_id for a in answers if a.WhichOneof("result") == "response")
    assert served == ["a", "b", "c"]
    for answer in answers:
        if answer.WhichOneof("result") == "response":
            assert len(answer.response.embed.embeddings) == 1
    refused: dict[str, tuple[str | None, str]] = {}
    for answer in answers:
        if answer.WhichOneof("result") == "error":
            assert answer.request_id == ""
            error = check_status(answer.error, [grpc.StatusCode.INVALID_ARGUMENT])
            assert error.info is not None and len(error.fields) == 1, error
            refused[error.fields[0]] = (error.reason, error.info.metadata.get("request_id", ""))
    path = "messages[{}].request.request_id".format
    assert refused == {
        path(2): ("REQUEST_ID_DUPLICATE", "a"),
        path(3): ("REQUEST_ID_MISSING", ""),
        path(4): ("REQUEST_ID_DUPLICATE", "b"),
        path(6): ("REQUEST_ID_DUPLICATE", "a"),
    }


BIG_ERRORS = {
    # 64 over-long texts: 64 INPUT_TOO_LONG violations, each in the message and BadRequest.
    "many_long_texts": (
        embed_request(["word " * 300] * MAX_CLIENT_BATCH_SIZE),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INPUT_TOO_LONG",
    ),
    # The unknown name (as long as a name may be) is echoed in the message, ErrorInfo
    # metadata and BadRequest.
    "long_model_name": (
        embed_request(["a"], model="m" * 256),
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
    ),
}


@pytest.mark.parametrize("case", sorted(BIG_ERRORS))
def test_big_error_details_reach_a_default_client(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub, case: str
) -> None:
    request, code, reason = BIG_ERRORS[case]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=30)
    assert_alive(server)
    got = caught.value
    assert got.code() == code, f"{got.code()}: {got.details()}"  # type: ignore[attr-defined]
    assert check_rpc_error(got, [code]).reason == reason


@pytest.mark.parametrize("case", sorted(BIG_ERRORS))
def test_big_error_details_in_band_on_a_stream(
    stub: pooling_pb2_grpc.PoolingServiceStub, case: str
) -> None:
    """The same errors travel in the message body on a stream, where no limit applies."""
    request, code, reason = BIG_ERRORS[case]
    message = pb.PoolStreamRequest(request=request)
    message.request.request_id = "big-error"
    answers = list(stub.PoolStream(iter([message]), timeout=30))
    assert len(answers) == 1
    assert check_status(answers[0].error, [code]).reason == reason


# Bytes no PoolingService request type parses (bad tags, wire types, lengths, varints).
GARBAGE = [
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\x0a\xff\xff\xff\xff\x0f",
    b"\x22\x05\x0a\x03ab",  # a field claims 5 bytes, 4 follow
    b"\x08" + b"\xff" * 12,  # a varint over 10 bytes
    b"\x07",  # wire type 7
    b"\x0a\x05ab",
]
# Field 1 is a string in PoolRequest (request_id) and TokenizeRequest (model): bad UTF-8.
BAD_UTF8 = b"\x0a\x02\xc3\x28"


@pytest.mark.parametrize("method", ["Pool", "ListModels", "Tokenize", "PoolStream"])
def test_garbage_bytes_to_every_method(server: ServerProcess, method: str) -> None:
    payloads = [*GARBAGE, BAD_UTF8] if method in ("Pool", "Tokenize") else GARBAGE
    with grpc.insecure_channel(server.address) as channel:
        for payload in payloads:
            if method == "PoolStream":  # answered in band; the stream ends OK
                call = channel.stream_stream(
                    f"/pooling.v1.PoolingService/{method}",
                    response_deserializer=pb.PoolStreamResponse.FromString,
                )
                [answer] = list(call(iter([payload]), timeout=30))
                error = check_status(answer.error, [grpc.StatusCode.INVALID_ARGUMENT])
            else:
                call = channel.unary_unary(f"/pooling.v1.PoolingService/{method}")
                with pytest.raises(grpc.RpcError) as caught:
                    call(payload, timeout=30)
                error = check_rpc_error(caught.value, [grpc.StatusCode.INVALID_ARGUMENT])
            assert error.reason == "MALFORMED_REQUEST", (method, payload)
    assert_alive(server)


def test_garbage_after_valid_requests_on_a_stream(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    """A stream whose 21st message does not parse answers it in band and goes on."""
    good = [
        pb.PoolStreamRequest(request=embed_request(["word " * 200] * 4, request_id=f"g{i}"))
        for i in range(21)
    ]
    payloads = [m.SerializeToString() for m in good]
    payloads.insert(20, GARBAGE[0])
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/pooling.v1.PoolingService/PoolStream",
            response_deserializer=pb.PoolStreamResponse.FromString,
        )
        answers = call(iter(payloads), timeout=60)
        received = list(answers)
        assert answers.code() == grpc.StatusCode.OK
    ok = sorted(a.request_id for a in received if a.HasField("response"))
    assert ok == sorted(f"g{i}" for i in range(21))
    [bad] = [a for a in received if a.HasField("error")]
    error = check_status(bad.error, [grpc.StatusCode.INVALID_ARGUMENT])
    assert (bad.request_id, error.reason, error.fields) == (
        "",
        "MALFORMED_REQUEST",
        ["messages[20]"],
    )
    assert_alive(server)


def test_message_over_the_size_limit(server: ServerProcess) -> None:
    """A request over --max-message-mb (16 MiB) is refused by gRPC itself, not a crash.

    grpc core answers RESOURCE_EXHAUSTED before any handler runs, so there is no ErrorInfo.
    """
    request = embed_request(["x" * (17 << 20)])
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/pooling.v1.PoolingService/Pool",
            request_serializer=pb.PoolRequest.SerializeToString,
            response_deserializer=pb.PoolResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert_alive(server)


EMPTY_ITEMS = [
    (
        "embed.items[1]",
        "Pool",
        pb.PoolRequest(embed=pb.TextInput(items=[pb.Item(text="a text"), pb.Item()])),
    ),
    ("classify.items[0]", "Pool", pb.PoolRequest(classify=pb.TextInput(items=[pb.Item()]))),
    (
        "score.items_2[0]",
        "Pool",
        pb.PoolRequest(score=pb.ScoreInput(items_1=[pb.Item(text="q")], items_2=[pb.Item()])),
    ),
    (
        "items[2]",
        "Rerank",
        pb.RerankRequest(query="q", items=[pb.Item(text="d")] * 2 + [pb.Item()]),
    ),
]


@pytest.mark.parametrize(
    ("field", "method", "request_"), EMPTY_ITEMS, ids=[e[0] for e in EMPTY_ITEMS]
)
def test_an_item_with_neither_text_nor_image_is_refused_by_name(
    stub: pooling_pb2_grpc.PoolingServiceStub, field: str, method: str, request_: object
) -> None:
    """Read as an empty text, such an Item was embedded; it names itself, as any bad field."""
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, method)(request_, timeout=30)
    error = check_rpc_error(caught.value, [grpc.StatusCode.INVALID_ARGUMENT])
    assert (error.reason, error.fields) == ("ITEM_EMPTY", [field]), error.message


def test_still_serving_after_bad_input(
    server: ServerProcess, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    assert_alive(server)
    response = stub.Pool(embed_request(["still fine"]), timeout=30)
    assert len(response.embed.embeddings[0].values) == 384
