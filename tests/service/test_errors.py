"""The errors table as a table: every kind and reason in it renders on gRPC (code and
google.rpc details) and on each HTTP family (status, envelope, Retry-After), and the
explicit rows below say what each must be, so that a change to the table shows here."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.service.errors import (
    TABLE,
    Family,
    FieldMap,
    from_http,
    grpc_code,
    http_error,
    http_status,
    status_label,
    to_grpc_status,
    to_status_proto,
)
from pooling_server.service.http.cohere import COHERE_FIELDS
from pooling_server.service.http.json_body import BodyError
from pooling_server.service.http.tei import TEI_FIELDS

G, K = grpc.StatusCode, ErrorKind
# (kind, reason): (gRPC code, OpenAI/vLLM status, TEI status, TEI error_type, Cohere status).
# Written out, not derived: these are what clients see today.
EXPECTED: dict[tuple[ErrorKind, str], tuple[grpc.StatusCode, int, int, str, int]] = {
    (K.INVALID_ARGUMENT, ""): (G.INVALID_ARGUMENT, 400, 422, "Validation", 400),
    (K.INVALID_ARGUMENT, "INVALID_BODY"): (G.INVALID_ARGUMENT, 422, 422, "Validation", 400),
    (K.INVALID_ARGUMENT, "EMPTY_INPUT"): (G.INVALID_ARGUMENT, 400, 400, "Empty", 400),
    (K.INVALID_ARGUMENT, "TOO_MANY_INPUTS"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "REQUEST_TOO_LARGE"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "OUTPUT_TOO_LARGE"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "IMAGE_TOO_LARGE"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "TOO_MANY_IMAGES"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "AUDIO_TOO_LARGE"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "AUDIO_TOO_LONG"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "TOO_MANY_AUDIO_CLIPS"): (G.INVALID_ARGUMENT, 400, 413, "Validation", 400),
    (K.INVALID_ARGUMENT, "INPUT_TOO_LONG"): (G.INVALID_ARGUMENT, 400, 422, "Tokenizer", 400),
    (K.INVALID_ARGUMENT, "TOKEN_ID_INVALID"): (G.INVALID_ARGUMENT, 400, 422, "Tokenizer", 400),
    (K.INVALID_ARGUMENT, "METHOD_NOT_ALLOWED"): (G.UNIMPLEMENTED, 405, 405, "Validation", 405),
    (K.INVALID_ARGUMENT, "EXPECTATION_FAILED"): (G.INVALID_ARGUMENT, 417, 417, "Validation", 417),
    (K.INVALID_ARGUMENT, "COMPRESSED_WITHOUT_ENCODING"): (G.INTERNAL, 400, 422, "Validation", 400),
    (K.INVALID_ARGUMENT, "ENCODING_UNSUPPORTED"): (G.UNIMPLEMENTED, 415, 415, "Validation", 415),
    (K.NOT_FOUND, ""): (G.NOT_FOUND, 404, 422, "Validation", 404),
    (K.NOT_FOUND, "NOT_FOUND"): (G.UNIMPLEMENTED, 404, 404, "Validation", 404),
    (K.FAILED_PRECONDITION, ""): (G.FAILED_PRECONDITION, 412, 424, "Backend", 400),
    (K.FAILED_PRECONDITION, "MODEL_LOAD_FAILED"): (G.FAILED_PRECONDITION, 424, 424, "Backend", 424),
    (K.FAILED_PRECONDITION, "ADAPTER_LOAD_FAILED"): (
        G.FAILED_PRECONDITION,
        424,
        424,
        "Backend",
        424,
    ),
    (K.RESOURCE_EXHAUSTED, ""): (G.RESOURCE_EXHAUSTED, 429, 429, "Overloaded", 429),
    (K.RESOURCE_EXHAUSTED, "REQUEST_ENTITY_TOO_LARGE"): (
        G.RESOURCE_EXHAUSTED,
        413,
        413,
        "Validation",
        413,
    ),
    (K.DEADLINE_EXCEEDED, ""): (G.DEADLINE_EXCEEDED, 504, 504, "Backend", 504),
    (K.DEADLINE_EXCEEDED, "BODY_TIMEOUT"): (G.DEADLINE_EXCEEDED, 408, 408, "Validation", 408),
    (K.CANCELLED, ""): (G.CANCELLED, 499, 499, "Backend", 499),
    (K.UNAVAILABLE, ""): (G.UNAVAILABLE, 503, 503, "Unhealthy", 503),
    (K.UNAUTHENTICATED, ""): (G.UNAUTHENTICATED, 401, 401, "Validation", 401),
    (K.INTERNAL, ""): (G.INTERNAL, 500, 424, "Backend", 500),
    (K.INTERNAL, "HANDLER_FAILED"): (G.UNKNOWN, 500, 424, "Backend", 500),
}
# TEI's ErrorType (docs/openapi.json of text-embeddings-inference).
TEI_TYPES = {"Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"}
OPENAI_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
}


def test_every_kind_has_a_row_and_every_row_an_expectation() -> None:
    assert {kind for kind, reason in TABLE if reason == ""} == set(ErrorKind)
    assert set(TABLE) == set(EXPECTED)


def _error(kind: ErrorKind, reason: str) -> PoolingError:
    """One error of the row, with a field violation and a retry delay to render."""
    violation = FieldViolation("embed.texts[3]", "bad text", reason or "SOME_REASON")
    return PoolingError(
        kind, reason or "SOME_REASON", "embed.texts[3]: bad text", (violation,), {}, 2.0
    )


@pytest.mark.parametrize(("kind", "reason"), list(TABLE), ids=lambda key: str(key))
def test_row_renders_on_grpc(kind: ErrorKind, reason: str) -> None:
    code = EXPECTED[(kind, reason)][0]
    error = _error(kind, reason)
    assert grpc_code(error) is code
    status = to_status_proto(error)
    assert status.code == code.value[0] and status.message == error.message
    details = {detail.type_url.rsplit("/", 1)[-1]: detail for detail in status.details}
    info = error_details_pb2.ErrorInfo()
    details["google.rpc.ErrorInfo"].Unpack(info)
    assert (info.reason, info.domain) == (error.reason, "pooling.v1")
    bad = error_details_pb2.BadRequest()
    details["google.rpc.BadRequest"].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["embed.texts[3]"]
    retry = error_details_pb2.RetryInfo()
    details["google.rpc.RetryInfo"].Unpack(retry)
    assert retry.retry_delay.seconds == 2
    assert to_grpc_status(error).code is code


@pytest.mark.parametrize(("kind", "reason"), list(TABLE), ids=lambda key: str(key))
def test_row_renders_on_every_http_family(kind: ErrorKind, reason: str) -> None:
    _, openai, tei, tei_type, cohere = EXPECTED[(kind, reason)]
    error = _error(kind, reason)

    answer = http_error(error, Family.OPENAI)
    assert answer.status == openai == http_status(error)
    detail = answer.body["error"]
    assert detail["code"] == detail["reason"] == error.reason
    assert detail["param"] == "embed.texts[3]" and detail["message"] == error.message
    assert detail["type"] in OPENAI_TYPES
    assert (detail["type"] == "server_error") == (openai >= 500)
    assert detail["retry_after_s"] == 2.0

    answer = http_error(error, Family.TEI, TEI_FIELDS)
    assert answer.status == tei and answer.body == {
        "error": "inputs[3]: bad text",
        "error_type": tei_type,
    }
    assert tei_type in TEI_TYPES

    answer = http_error(error, Family.COHERE, COHERE_FIELDS, "embed-1")
    assert answer.status == cohere
    prefix = "invalid request: " if cohere == 400 else ""
    assert answer.body == {
        "id": "embed-1",
        "message": f"{prefix}texts[3]: bad text",
        "reason": error.reason,
    }

    for family, status in ((Family.OPENAI, openai), (Family.TEI, tei), (Family.COHERE, cohere)):
        headers = http_error(error, family).headers
        assert headers == ({"Retry-After": "2"} if status in (429, 503) else {}), family


def test_field_maps_translate_paths_and_advice_not_other_messages() -> None:
    long = PoolingError.invalid(
        [
            FieldViolation(
                "token_embed.texts[1]",
                "has 300 tokens, more than the model's maximum of 128; shorten it or set "
                "params.truncate_prompt_tokens (-1 truncates to the maximum)",
                "INPUT_TOO_LONG",
            )
        ]
    )
    tei = TEI_FIELDS.error(long)
    assert tei.message == (
        "inputs[1]: has 300 tokens, more than the model's maximum of 128; "
        "shorten it or set truncate to true"
    )
    assert tei.violations[0].field == "inputs[1]" and tei.reason == "INPUT_TOO_LONG"
    dimensions = PoolingError.invalid(
        [FieldViolation("params.dimensions", "must be at most 32", "DIMENSIONS_OUT_OF_RANGE")]
    )
    assert COHERE_FIELDS.error(dimensions).message == "output_dimension: must be at most 32"
    assert TEI_FIELDS.error(dimensions).message == "dimensions: must be at most 32"
    # A field the door named itself, and a message not made of the violations, stay.
    door = BodyError("embed.texts_and_more", "x")
    assert TEI_FIELDS.error(door) is door
    custom = PoolingError(
        ErrorKind.NOT_FOUND,
        "MODEL_NOT_FOUND",
        'model "embed.texts" is not served',
        (FieldViolation("model", "unknown", "MODEL_NOT_FOUND"),),
    )
    assert TEI_FIELDS.error(custom) is custom
    assert FieldMap().error(long) is long


def test_status_labels_and_aiohttp_refusals_come_from_the_table() -> None:
    assert status_label("grpc", None) == "OK" and status_label("http", None) == "200"
    for kind in ErrorKind:
        code, http = EXPECTED[(kind, "")][:2]
        assert status_label("grpc", kind) == code.name
        assert status_label("http", kind) == status_label("batch", kind) == str(http)
    assert http_status(from_http(404, "Not Found", "404: Not Found")) == 404
    assert http_status(from_http(405, "Method Not Allowed", "no")) == 405
    assert http_status(from_http(413, "Request Entity Too Large", "big")) == 413
    teapot = from_http(418, "I'm a Teapot", "no")
    assert (teapot.kind, http_status(teapot)) == (ErrorKind.INVALID_ARGUMENT, 400)
    assert http_status(from_http(502, "Bad Gateway", "x")) == 500


def test_a_door_refusal_is_a_pooling_error() -> None:
    error = BodyError("input", "must be a string or a list of strings")
    assert isinstance(error, PoolingError)
    answer = http_error(error)
    assert answer.status == 422 and answer.body["error"]["param"] == "input"
    assert answer.body["error"]["message"] == "input: must be a string or a list of strings"
