"""Pair truncation: long sides are cut before `tokenizers` truncates, with the same tokens."""

from __future__ import annotations

import random

import grpc
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec
from pooling_server.service.proto import pooling_pb2, pooling_pb2_grpc
from tests.fixture_models import MINILM

WORDS = ["play", "playing", "unbelievable", "-", "é", "[SEP]", "\r\n", "42", "naïve", "日本", "🙂"]


@pytest.fixture(scope="module")
def spec() -> TokenizerSpec:
    return TokenizerSpec.of(AutoTokenizer.from_pretrained(MINILM))


def test_cut_pairs_give_what_tokenizers_truncation_gives(spec: TokenizerSpec) -> None:
    """Ids, offsets (into the whole texts), type ids and special masks, both directions."""
    ours = ModelTokenizer(spec, 512)
    reference = Tokenizer.from_str(spec.source)
    reference.no_padding()
    rng = random.Random(19)
    cut = 0
    for _ in range(300):
        a, b = (" ".join(rng.choices(WORDS, k=rng.choice([1, 5, 60, 400]))) for _ in "ab")
        length, side = rng.choice([4, 8, 16, 64, 128]), rng.choice(["right", "left"])
        reference.enable_truncation(length, strategy="longest_first", direction=side)
        want = reference.encode(a, b)
        [got] = ours.tokenize([a], [b], truncate=length, side=side)
        assert got.input_ids == want.ids, (len(a), len(b), length, side)
        assert got.offsets == [tuple(o) for o in want.offsets]
        assert got.token_type_ids == want.type_ids
        assert got.special_mask == want.special_tokens_mask
        cut += len(a) + len(b) > 4 * length
    assert cut > 100  # the premise: most pairs were long enough to be cut


def test_long_pairs_truncated_short_are_answered(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    """7,400 and 800 tokens truncated to 8: tokenizers alone took 19 s per pair (found by
    test_bad_input's random requests), more than the deadline here."""
    long_text = "- " * 7_400
    request = pooling_pb2.PoolRequest(
        model="tiny-cross-encoder",
        params=pooling_pb2.PoolingParams(truncate_prompt_tokens=8),
        score=pooling_pb2.ScoreInput(text_1=[long_text], text_2=["é " * 800, "x [SEP] " * 300]),
    )
    try:
        response = stub.Pool(request, timeout=10)
    except grpc.RpcError as error:  # the failure this test is for
        pytest.fail(f"{error.code().name}: {error.details()}")
    assert len(response.score.scores) == 2
    assert response.usage.prompt_tokens == 16  # each pair truncated to 8 tokens
