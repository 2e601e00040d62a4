"""Helpers shared by the reliability tests: figures, error checks, metrics, references."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import numpy as np
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2

from pooling_client.v1 import pooling_pb2 as pb
from tests.metrics_endpoint import metric_sum, scrape
from tests.rpc_errors import DecodedError, decode_rpc_error, decode_status
from tests.server_process import ServerProcess

DOMAIN = "pooling.v1"
# The codes a request may fail with because of what it asked for.
CLIENT_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
SERVING = health_pb2.HealthCheckResponse.SERVING


def report(record_property: Callable[[str, object], None], name: str, **figures: object) -> str:
    """Print one `RELIABILITY <name>: key=value ...` line and record each figure on the test."""
    line = f"RELIABILITY {name}: " + " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    print(line, flush=True)
    record_property("reliability", line)
    for key, value in figures.items():
        record_property(key, _fmt(value))
    return line


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in sorted(value.items())) or "-"
    return str(value)


def documented_error(error: DecodedError, allowed: Iterable[grpc.StatusCode]) -> str | None:
    """None when the error is one of `allowed` with ErrorInfo in our domain, else the problem."""
    allowed = frozenset(allowed)
    if error.code not in allowed:
        return f"code {error.code.name} not in {sorted(c.name for c in allowed)}: {error.message}"
    if error.info is None:
        return f"{error.code.name} without ErrorInfo: {error.message}"
    if error.info.domain != DOMAIN or not error.info.reason:
        return f"bad ErrorInfo domain={error.info.domain!r} reason={error.info.reason!r}"
    return None


def check_rpc_error(error: grpc.RpcError, allowed: Iterable[grpc.StatusCode]) -> DecodedError:
    decoded = decode_rpc_error(error)
    problem = documented_error(decoded, allowed)
    assert problem is None, problem
    return decoded


def check_status(status: status_pb2.Status, allowed: Iterable[grpc.StatusCode]) -> DecodedError:
    decoded = decode_status(status)
    problem = documented_error(decoded, allowed)
    assert problem is None, problem
    return decoded


def output_count(response: pb.PoolResponse) -> int:
    case = response.WhichOneof("output")
    if case == "embed":
        return len(response.embed.embeddings)
    if case == "classify":
        return len(response.classify.classifications)
    if case == "score":
        return len(response.score.scores)
    if case in ("token_embed", "token_classify"):
        return len(getattr(response, case).items)
    return 0


def input_count(request: pb.PoolRequest) -> int:
    case = request.WhichOneof("input")
    if case == "score":
        return max(len(request.score.text_1), len(request.score.text_2))
    return len(getattr(request, case).texts) if case else 0


def check_success(request: pb.PoolRequest, response: pb.PoolResponse) -> None:
    """The output case matches the input case and holds one well-formed result per input."""
    case = request.WhichOneof("input")
    assert response.request_id == request.request_id
    assert response.WhichOneof("output") == case, (case, response.WhichOneof("output"))
    assert output_count(response) == input_count(request)
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens
    dims = request.params.dimensions if request.params.HasField("dimensions") else None
    if case == "embed":
        for embedding in response.embed.embeddings:
            assert len(embedding.values) == dims if dims else len(embedding.values) > 0
            assert np.isfinite(embedding.values).all()
    elif case == "classify":
        for item in response.classify.classifications:
            assert len(item.probs) > 0 and np.isfinite(item.probs).all()
            assert item.label_id == int(np.argmax(item.probs)) and item.label
    elif case == "score":
        assert np.isfinite(response.score.scores).all()
    elif case in ("token_embed", "token_classify"):
        texts = getattr(request, case).texts
        for text, item in zip(texts, getattr(response, case).items, strict=True):
            assert item.rows == len(item.token_ids) == len(item.offsets) > 0
            assert len(item.special_tokens_mask) == item.rows
            assert len(item.values) == item.rows * item.cols
            assert np.isfinite(item.values).all()
            if case == "token_embed" and dims:
                assert item.cols == dims
            if case == "token_classify":
                assert len(item.label_ids) == len(item.labels) == item.rows
            for span in item.offsets:  # code points into the text, end exclusive
                assert 0 <= span.start <= span.end <= len(text), (span, len(text))


def embed_request(
    texts: Iterable[str], model: str = "", request_id: str = "", **params: Any
) -> pb.PoolRequest:
    return pb.PoolRequest(
        request_id=request_id,
        model=model,
        params=pb.PoolingParams(**params),
        embed=pb.TextInput(texts=list(texts)),
    )


def vector(response: pb.PoolResponse, index: int = 0) -> np.ndarray:
    return np.asarray(response.embed.embeddings[index].values, dtype=np.float32)


def same_vector(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to the float noise batching with padding may add."""
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-3, atol=1e-4))


def wait_queue_empty(metrics_port: int, timeout: float = 30.0) -> float:
    """Poll pooling_queue_depth until every model's queue is empty; returns seconds waited."""
    started = time.monotonic()
    depth = -1.0
    while time.monotonic() - started < timeout:
        depth = metric_sum(scrape(metrics_port), "pooling_queue_depth")
        if depth == 0:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"queue depth still {depth} after {timeout}s")


def assert_alive(server: ServerProcess) -> None:
    assert server.process.poll() is None, f"server exited:\n{server.log()[-4000:]}"
    assert server.health() == SERVING
