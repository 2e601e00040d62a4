"""vLLM's `bytes` answers keep their `metadata` header readable: vLLM's own form while it
is small, a compact one past METADATA_MAX_BYTES, so that a 1,024-text answer passes
Python's http.client (64 KB a line) and a proxy's 8 KB header buffer (issue 43)."""

from __future__ import annotations

import json
from http.client import HTTPConnection, HTTPResponse

import numpy as np
import pytest

from pooling_server.engine.errors import PoolingError
from pooling_server.service.http.float_format import (
    EMBED_DTYPES,
    METADATA_MAX_BYTES,
    FloatFormat,
    header_metadata,
)
from tests.service.http.test_openai import KEY, HttpServer, http  # noqa: F401  (the server)

PROXY_HEADER_BUFFER = 8192  # nginx's proxy_buffer_size at most, for every header at once
HEAD = {"id": "embd-1", "created": 1, "model": "m", "usage": {"prompt_tokens": 9}}


def _layout(metadata: dict, count: int) -> list[tuple[int, int, list[int]]]:
    """(start, end, shape) of each array, from either form, as a client reads it."""
    if "data" in metadata:
        return [(item["start"], item["end"], item["shape"]) for item in metadata["data"]]
    width = EMBED_DTYPES[metadata["embed_dtype"]]
    rows = metadata.get("rows")
    at, layout = 0, []
    for index in range(metadata["count"]):
        shape = metadata["shape"] if rows is None else [rows[index], *metadata["shape"]]
        end = at + int(np.prod(shape)) * width
        layout.append((at, end, shape))
        at = end
    assert len(layout) == count
    return layout


def test_small_answers_keep_vllms_form() -> None:
    arrays = [np.ones(8, np.float32)] * 3
    metadata = header_metadata(FloatFormat("bytes", "float16"), arrays, HEAD)
    assert [item["shape"] for item in metadata["data"]] == [[8]] * 3
    assert [(i["start"], i["end"]) for i in metadata["data"]] == [(0, 16), (16, 32), (32, 48)]
    assert metadata["data"][0]["embed_dtype"] == "float16"


def test_many_vectors_take_the_compact_form_within_the_bound() -> None:
    arrays = [np.ones(384, np.float32)] * 1024
    metadata = header_metadata(FloatFormat("bytes"), arrays, HEAD)
    assert len(json.dumps(metadata)) <= METADATA_MAX_BYTES
    assert (metadata["count"], metadata["shape"], metadata["model"]) == (1024, [384], "m")
    assert _layout(metadata, 1024)[-1] == (1023 * 1536, 1024 * 1536, [384])


def test_matrices_of_different_lengths_list_their_rows() -> None:
    arrays = [np.ones((n % 500 + 1, 32), np.float32) for n in range(1024)]
    metadata = header_metadata(FloatFormat("bytes"), arrays, HEAD)
    assert len(json.dumps(metadata)) <= METADATA_MAX_BYTES
    assert metadata["shape"] == [32] and metadata["rows"][:3] == [1, 2, 3]


def test_a_header_that_cannot_fit_is_refused_by_name() -> None:
    arrays = [np.ones((n + 1000, 4), np.float32) for n in range(3000)]
    with pytest.raises(PoolingError) as caught:
        header_metadata(FloatFormat("bytes"), arrays, HEAD)
    assert caught.value.reason == "METADATA_TOO_LARGE"


def _post(server: HttpServer, path: str, body: dict) -> HTTPResponse:
    """The answer as Python's http.client reads it (which refuses lines over 64 KB)."""
    connection = HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    connection.request("POST", path, json.dumps(body), headers)
    return connection.getresponse()


@pytest.mark.parametrize("task", ["embed", "token_embed"])
def test_a_1024_text_bytes_answer_reads_back_through_http_client(
    http: HttpServer,  # noqa: F811
    task: str,
) -> None:
    texts = [f"text number {n} " + "word " * (n % 13) for n in range(1024)]
    body = {"model": "tiny-bert", "input": texts, "encoding_format": "bytes", "task": task}
    path = "/v1/embeddings" if task == "embed" else "/pooling"
    answer = _post(http, path, body)
    content = answer.read()
    assert answer.status == 200, content[:500]
    header_bytes = sum(len(k) + len(v) + 4 for k, v in answer.getheaders())
    assert header_bytes <= PROXY_HEADER_BUFFER, header_bytes
    metadata = json.loads(answer.getheader("metadata"))
    assert metadata["usage"]["prompt_tokens"] > 1024
    layout = _layout(metadata, 1024)
    assert layout[-1][1] == len(content)
    only = _post(http, path, {**body, "encoding_format": "bytes_only"}).read()
    assert only == content  # the same arrays, whatever the header says of them
    start, end, shape = layout[7]
    np.frombuffer(content[start:end], "<f4").reshape(shape)  # each lies where it says
