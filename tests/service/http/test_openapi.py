"""GET /openapi.json on a real server: an OpenAPI 3.1 document listing every route the
app serves, each POST route with its body's JSON Schema (generated from the declared
body types), and real request bodies held against it: those the server answers are
valid, and those it refuses for their shape are not."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from pooling_server.service.http.cohere import COHERE_BODIES
from pooling_server.service.http.openai import ROUTES
from pooling_server.service.http.tei import TEI_BODIES
from tests.service.doors_server import DoorsServer

# The routes every server serves, by method, and the body each POST route's schema names.
GETS = ("/v1/models", "/health", "/info", "/openapi.json")
POSTS: dict[str, set[str]] = {
    **{path: {route.body.__name__} for path, route in ROUTES.items()},
    **{path: {kind.__name__ for kind in kinds} for path, kinds in TEI_BODIES.items()},
    **{path: {kind.__name__ for kind in kinds} for path, kinds in COHERE_BODIES.items()},
    "/rerank": {"RerankBody", "TeiRerank"},  # the route takes either shape
}
PNG = (  # a 1x1 PNG, as a data URL
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4"
    "//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"
)
# (route, body, the status the server answers): a body the server serves or refuses for a
# value (200, or the engine's 4xx) fits the schema; one refused for its shape does not.
FITTING: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/embeddings", {"model": "embedder", "input": ["a", "b"], "user": "an unknown field"}, 200),
    ("/v1/embeddings", {"input": "a", "encoding_format": "base64", "embed_dtype": "float16"}, 200),
    ("/v1/embeddings", {"input": "a", "late_chunking": {"rule": "sentences"}}, 200),
    # An image part on a text model: the shape is right; the model refuses the image.
    ("/v1/embeddings", {"input": [{"type": "image_url", "image_url": {"url": PNG}}]}, 412),
    ("/pooling", {"input": ["a"], "task": "token_embed", "truncate_prompt_tokens": 4}, 200),
    ("/classify", {"model": "classifier", "input": "a", "use_activation": False}, 200),
    ("/score", {"model": "cross", "text_1": "q", "text_2": ["a", "b"]}, 200),
    ("/rerank", {"model": "cross", "query": "q", "documents": ["a", {"text": "b"}]}, 200),
    ("/rerank", {"model": "cross", "query": "q", "texts": ["a", "b"]}, 200),
    ("/embed", {"inputs": ["a", "b"], "normalize": False, "truncate": True}, 200),
    ("/predict", {"model": "classifier", "inputs": [["a"], ["b"]]}, 200),
    ("/decode", {"ids": [[101, 102]]}, 200),
    ("/v2/embed", {"texts": ["a"], "input_type": "search_query", "embedding_types": ["int8"]}, 200),
    ("/v2/rerank", {"model": "cross", "query": "q", "documents": ["a"], "top_n": 1}, 200),
]
MISFITTING: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/embeddings", {"input": "a", "dimensions": 1.5}, 422),
    ("/v1/embeddings", {"input": "a", "encoding_format": "bogus"}, 400),
    ("/v1/embeddings", {"input": "a", "top_n": 1, "truncate_prompt_tokens": 2**40}, 400),
    ("/v1/embeddings", {"input": [{"type": "video", "video": "x"}]}, 422),
    ("/pooling", {"input": "a", "late_chunking": {"rule": "sentences", "size": 3}}, 422),
    ("/score", {"model": "cross", "text_1": "q"}, 422),
    ("/embed", {"inputs": "a", "normalize": "yes"}, 422),
    ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": 2**40}, 400),
]


@pytest.fixture(scope="module")
def document(doors: DoorsServer) -> dict[str, Any]:
    status, headers, answer = doors.call("/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json"), answer
    return answer  # type: ignore[no-any-return]


def _validator(document: dict[str, Any], path: str) -> jsonschema.Draft202012Validator:
    """The schema of `path`'s POST body, its references read in the whole document."""
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    root = {**schema["schema"], "components": document["components"]}
    return jsonschema.Draft202012Validator(root)


def test_every_served_route_is_listed_with_its_body(
    doors: DoorsServer, document: dict[str, Any]
) -> None:
    assert document["openapi"] == "3.1.0"
    jsonschema.Draft202012Validator.check_schema({"$defs": document["components"]["schemas"]})
    paths = document["paths"]
    assert set(paths) >= set(GETS) | set(POSTS)
    for path in GETS:
        assert "get" in paths[path] and "requestBody" not in paths[path]["get"], path
    schemas = document["components"]["schemas"]
    for path, names in POSTS.items():
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [body] if "$ref" in body else body["anyOf"]
        named = {ref["$ref"].rsplit("/", 1)[1] for ref in refs}
        assert named == names, (path, named)
        for name in named:
            assert schemas[name]["type"] == "object", name
    # Each route listed is served: none answers 404 or 405 (an empty body is refused by
    # the route itself).
    for path, operations in paths.items():
        for method in operations:
            status = doors.call(path, {} if method == "post" else None)[0]
            assert status not in (404, 405), (method, path, status)


@pytest.mark.parametrize(("path", "body", "status"), FITTING)
def test_bodies_the_server_takes_fit_the_schema(
    doors: DoorsServer, document: dict[str, Any], path: str, body: dict[str, Any], status: int
) -> None:
    got, _, answer = doors.call(path, body)
    assert got == status, answer
    _validator(document, path).validate(body)


@pytest.mark.parametrize(("path", "body", "status"), MISFITTING)
def test_bodies_refused_for_their_shape_do_not_fit(
    doors: DoorsServer, document: dict[str, Any], path: str, body: dict[str, Any], status: int
) -> None:
    got, _, answer = doors.call(path, body)
    assert got == status, answer
    assert not _validator(document, path).is_valid(body), body
