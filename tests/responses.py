"""Comparing answers: two PoolResponses (every field equal, floats within a tolerance), and a
ranking with its reference scores (in_document_order).

Batching changes padding, so floats from a burst differ from one-by-one results in the
last bits; everything else (ids, labels, token ids, usage) must match exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from pooling_client.v1 import pooling_pb2 as pb

ATOL = 1e-5


def split_floats(message: Message) -> tuple[Message, np.ndarray]:
    """A copy of the message without its float fields, and those floats in order."""
    rest = type(message)()
    rest.CopyFrom(message)
    floats: list[float] = []

    def walk(node: Message) -> None:
        for descriptor, value in node.ListFields():
            if descriptor.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
                if descriptor.is_repeated:
                    floats.extend(value)
                    del value[:]
                else:
                    floats.append(value)
                    node.ClearField(descriptor.name)
            elif descriptor.type == FieldDescriptor.TYPE_MESSAGE:
                for child in value if descriptor.is_repeated else [value]:
                    walk(child)

    walk(rest)
    return rest, np.array(floats, dtype=np.float64)


def assert_same_response(got: pb.PoolResponse, want: pb.PoolResponse) -> None:
    got_rest, got_floats = split_floats(got)
    want_rest, want_floats = split_floats(want)
    assert got_rest == want_rest, want.request_id
    assert got_floats.shape == want_floats.shape, want.request_id
    if want_floats.size:
        assert float(np.max(np.abs(got_floats - want_floats))) <= ATOL, want.request_id


def in_document_order(results: Iterable[tuple[int, float]], documents: int) -> np.ndarray:
    """A ranking's (index, score) pairs as scores in document order, once checked to come
    best first; a document the ranking left out stays NaN."""
    results = list(results)
    scores = [score for _, score in results]
    assert scores == sorted(scores, reverse=True)
    out = np.full(documents, np.nan)
    for index, score in results:
        out[index] = score
    return out
