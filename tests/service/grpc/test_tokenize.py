"""Tokenize and ListModels through the request runner, on a real server (the doors' one).

Both are counted in /metrics under their RPC with their status, like Pool; Tokenize's
answer (laid out from token arrays, not built as a message per token) gives the ids the
tokenizer gives, and one past --max-message-mb is refused naming that cap, once its
tokens are counted exactly (texts of few words and many tokens pass the word-count floor).
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from transformers import AutoTokenizer

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM
from tests.metrics_endpoint import metric_growth, scrape
from tests.service.doors_server import KEY, DoorsServer

pytestmark = pytest.mark.timeout(300)

AUTH = (("authorization", f"Bearer {KEY}"),)
TEXTS = ["Hello world", 'the quick brown fox, jumps: over 東京 "quoted" \\ \n tabs\t', ""]


@pytest.fixture(scope="module")
def stub(doors: DoorsServer) -> pooling_pb2_grpc.PoolingServiceStub:
    channel = grpc.insecure_channel(
        doors.process.address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    return pooling_pb2_grpc.PoolingServiceStub(channel)


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def test_tokenize_gives_the_tokenizers_ids_spans_and_tokens(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    reference = AutoTokenizer.from_pretrained(MINILM)
    for special in (True, False):
        request = pb.TokenizeRequest(texts=TEXTS, add_special_tokens=special)
        answer = stub.Tokenize(request, metadata=AUTH, timeout=60)
        assert answer.model == "embedder" and answer.max_input_tokens > 0
        assert len(answer.items) == len(TEXTS)
        for text, item in zip(TEXTS, answer.items, strict=True):
            expected = reference(text, add_special_tokens=special, return_offsets_mapping=True)
            assert list(item.token_ids) == expected["input_ids"]
            assert list(item.tokens) == reference.convert_ids_to_tokens(expected["input_ids"])
            spans = [(span.start, span.end) for span in item.offsets]
            assert spans == [tuple(pair) for pair in expected["offset_mapping"]]


def test_tokenize_and_list_models_are_counted_with_their_status(
    doors: DoorsServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    before = scrape(doors.metrics_port)
    stub.Tokenize(pb.TokenizeRequest(texts=["counted"]), metadata=AUTH, timeout=60)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Tokenize(pb.TokenizeRequest(model="nope", texts=["x"]), metadata=AUTH, timeout=60)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=60)
    after = scrape(doors.metrics_port)

    delta = metric_growth(before, after, "pooling_requests_total")
    grpc_ = {"protocol": "grpc"}
    assert delta(rpc="Tokenize", code="OK", model="embedder", task="tokenize", **grpc_) == 1
    assert delta(rpc="Tokenize", code="NOT_FOUND", model="unknown", **grpc_) == 1
    assert delta(rpc="ListModels", code="OK", model="none", **grpc_) == 1


def test_an_answer_past_the_message_cap_is_refused_naming_it(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    """16 texts of 65,538 CJK characters: one word each, so the floor lets them through,
    but a token per character, about 18 MB of answer over 16 MiB."""
    texts = ["東京大" * 21846] * 16
    with pytest.raises(grpc.RpcError) as refused:
        stub.Tokenize(pb.TokenizeRequest(texts=texts), metadata=AUTH, timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(refused.value) == "OUTPUT_TOO_LARGE"
    assert "--max-message-mb" in (refused.value.details() or "")
    # A quarter of them fits, and is served whole.
    answer = stub.Tokenize(pb.TokenizeRequest(texts=texts[:4]), metadata=AUTH, timeout=120)
    assert [len(item.token_ids) for item in answer.items] == [len(texts[0]) + 2] * 4
