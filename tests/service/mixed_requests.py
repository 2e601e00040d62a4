"""Requests of every task with per-request params mixed, as a burst sends them: what the
request path's and the split server's tests answer one by one, then all at once, and
compare."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pooling_client.v1 import pooling_pb2 as pb
from tests.conftest import Served

# (task, model, params) of one kind of request.
Kind = tuple[str, str, dict[str, Any]]


# Every task on mixed_models, with params mixed so that per-request heads differ in a batch.
MIXED_KINDS: list[Kind] = [
    ("embed", "tiny-bert", {}),
    ("embed", "tiny-bert", {"use_activation": False}),
    ("embed", "tiny-matryoshka", {"dimensions": 16}),
    ("embed", "tiny-matryoshka", {"dimensions": 8, "use_activation": False}),
    ("classify", "tiny-classifier", {}),
    ("classify", "tiny-classifier", {"use_activation": False}),
    ("score", "tiny-cross-encoder", {}),
    ("score", "tiny-cross-encoder", {"use_activation": False}),
    ("token_embed", "tiny-bert", {}),
    ("token_embed", "tiny-matryoshka", {"dimensions": 8}),
    ("token_classify", "tiny-ner", {"use_activation": False}),
]


def mixed_models(folders: Mapping[str, Path]) -> list[Served]:
    """The fixture models the kinds name: tiny-bert, also as a Matryoshka model, a
    classifier, a cross-encoder and a token classifier."""
    bert = str(folders["tiny-bert"])
    return [
        Served("tiny-bert", bert),
        Served("tiny-matryoshka", bert, hf_overrides={"is_matryoshka": True}),
        *(Served(name, str(folders[name])) for name in ("tiny-classifier", "tiny-cross-encoder")),
        Served("tiny-ner", str(folders["tiny-ner"])),
    ]


def text_request(
    task: str, rid: str, texts: Sequence[str], model: str = "tiny-bert", **params: Any
) -> pb.PoolRequest:
    return pb.PoolRequest(
        request_id=rid,
        model=model,
        params=pb.PoolingParams(**params),
        **{task: pb.TextInput(texts=texts)},
    )


def phrases(sentence: str, most_words: int) -> Callable[..., str]:
    """phrase(i, k): a different text for every (i, k), of 2 to `most_words` of the
    sentence's words, so that a burst's texts differ in length within every batch."""
    words = sentence.split(" ")

    def phrase(i: int, k: int = 0) -> str:
        start = (i * 5 + k * 11) % len(words)
        length = 2 + (i * 7 + k * 3) % (most_words - 1)
        return f"text {i}.{k}: " + " ".join(words[(start + n) % len(words)] for n in range(length))

    return phrase


def mixed_requests(
    kinds: Sequence[Kind], count: int, phrase: Callable[..., str], query: str
) -> list[pb.PoolRequest]:
    """`count` requests cycling through `kinds`, each of 1 to 3 phrases; a score pairs
    `query` (numbered) with them."""
    requests = []
    for i in range(count):
        task, model, params = kinds[i % len(kinds)]
        rid = f"parity-{i}"
        texts = [phrase(i, k) for k in range(1 + i % 3)]
        if task == "score":
            score = pb.ScoreInput(text_1=[f"query {i}: {query}"], text_2=texts)
            request = pb.PoolRequest(
                request_id=rid, model=model, params=pb.PoolingParams(**params), score=score
            )
            requests.append(request)
        else:
            requests.append(text_request(task, rid, texts, model, **params))
    return requests
