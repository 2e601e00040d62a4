"""gRPC conformance: the same calls against every gRPC door, through two clients.

Each door (`--grpc-door grpcio`, `--grpc-door node`) serves the same models on a real port,
and each call is made through grpcio's client and through @grpc/grpc-js's (the official
Node.js client, driven by grpc_js_calls.mjs with raw-bytes serializers, so only its
transport is under test). What a user of either library expects of any gRPC server must hold
on every door: every method answers, every status code carries its google.rpc.Status,
deadlines and cancellation end calls, gzip works both ways, repeated metadata arrives
intact, the message cap holds, clients that ping too often are sent GOAWAY, connections age
out without losing calls in flight, a drain finishes what it accepted, and no malformed
input is answered INTERNAL. The wire-level cases speak bare HTTP/2 (h2), sending what no
client library would.

One server per door (and one more per door for connection age and the drain, which ends
it) serves the whole module; the grpc-js calls of a door run in one Node process.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from pooling_client.v1 import pooling_pb2 as pb
from tests.client.test_node_client import _require_node, install_node_modules
from tests.fixture_models import short_vocabulary_bert
from tests.rpc_errors import DecodedError, decode_status
from tests.server_process import ServerProcess, all_serving, spawn_server
from tests.service.doors_server import splade_folder

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("grpc_js_calls.mjs")
DOORS = ("grpcio", "node")
CLIENTS = ("grpcio", "grpc-js")
SERVICE = "/pooling.v1.PoolingService"
KEY = "conformance-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_MESSAGE = 1 << 20  # --max-message-mb 1
MAX_BATCH = 128  # --max-client-batch-size
MAX_QUEUED = 96  # --max-queued-items: a request of more texts is QUEUE_FULL at once
AGE_S = 1.0  # the edge server's --max-connection-age-s
DOMAIN = "pooling.v1"
DETAILS_KEY = "grpc-status-details-bin"
TIMING_KEYS = ("x-total-time-ms", "x-tokenization-time-ms", "x-queue-time-ms")
# A text of 130 words: past tiny-bert's 128 positions, so truncated to exactly 128 tokens.
LONG_TEXT = "alpha " * 130
ENHANCE_YOUR_CALM = 11


# --------------------------------------------------------------------------- doors and clients


def node_door_missing() -> str | None:
    """Why the Node door cannot run here, or None: no Node.js 20+, or a door whose npm
    dependencies are declared (a package.json under service/grpc/) but not installed."""
    node = shutil.which("node")
    if node is None:
        return "no `node` on PATH"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    if int(version.stdout.strip().lstrip("v").split(".")[0] or 0) < 20:
        return f"Node.js {version.stdout.strip()} is older than 20"
    for package in (ROOT / "service" / "grpc").rglob("package.json"):
        if "node_modules" not in package.parts and not (package.parent / "node_modules").is_dir():
            return f"{package.parent.relative_to(ROOT)}/node_modules is not installed"
    return None


def model_args(model_folders: dict[str, Path], root: Path) -> list[str]:
    """tiny-bert (the default: embed, token_embed), a classifier, a cross-encoder, a token
    classifier, a SPLADE model, and a BERT whose forward fails on most texts (INTERNAL)."""
    models = {
        "embedder": model_folders["tiny-bert"],
        "classifier": model_folders["tiny-classifier"],
        "cross": model_folders["tiny-cross-encoder"],
        "ner": model_folders["tiny-ner"],
        "splade": splade_folder(root),
        "broken": short_vocabulary_bert(root / "broken"),
    }
    args = [arg for name, folder in models.items() for arg in ("--model", f"{name}={folder}")]
    poolings = ["auto", "auto", "auto", "auto", "splade", "auto"]
    return args + [arg for pooling in poolings for arg in ("--pooling-type", pooling)]


@pytest.fixture(scope="module")
def doors() -> tuple[str, ...]:
    return DOORS if node_door_missing() is None else ("grpcio",)


@pytest.fixture(scope="module")
def servers(
    doors: tuple[str, ...],
    model_folders: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[tuple[str, str], ServerProcess]]:
    """Per door: `main` (gzip responses, a 1 MiB message cap, a small queue) for most tests,
    and `edge` (connections aged after 1 s) for connection age and, last, the drain."""
    root = tmp_path_factory.mktemp("conformance")
    common = ["--api-key", KEY, "--dtype", "float32", "--shutdown-grace-s", "20"]
    main = [*model_args(model_folders, root), *common, "--gzip-responses"]
    main += ["--max-message-mb", str(MAX_MESSAGE >> 20)]
    main += ["--max-client-batch-size", str(MAX_BATCH), "--max-queued-items", str(MAX_QUEUED)]
    edge = ["--model", f"embedder={model_folders['tiny-bert']}", *common]
    edge += ["--max-connection-age-s", str(AGE_S), "--max-connection-age-grace-s", "20"]
    started = {
        (door, role): spawn_server(["--grpc-door", door, *args], root, f"{door}-{role}")
        for door in doors
        for role, args in (("main", main), ("edge", edge))
    }
    with all_serving(started.values()):
        yield started


Servers = dict[tuple[str, str], ServerProcess]


def door_server(servers: Servers, door: str, role: str = "main") -> ServerProcess:
    if (door, role) not in servers:
        pytest.skip(f"--grpc-door {door} cannot run here: {node_door_missing()}")
    return servers[(door, role)]


# --------------------------------------------------------------------------- calls and outcomes


Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True)
class Call:
    """One call, as either client makes it: `kind` unary, server (streaming) or bidi."""

    path: str
    requests: tuple[bytes, ...]
    kind: str = "unary"
    metadata: Metadata = AUTH
    timeout_s: float | None = 30.0
    gzip: bool = False
    cancel_after_s: float | None = None  # a unary call: cancel it this long after it starts
    cancel_after_answers: int | None = None  # a stream: cancel it once this many answers came


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    messages: list[bytes]
    trailers: list[tuple[str, str | bytes]] = field(default_factory=list)

    def values(self, key: str) -> list[str | bytes]:
        return [value for k, value in self.trailers if k == key]

    def status(self) -> status_pb2.Status | None:
        """The google.rpc.Status of grpc-status-details-bin, checked against the call's own
        code and message: the one -bin trailer every error carries must arrive intact."""
        found = self.values(DETAILS_KEY)
        if not found:
            return None
        assert len(found) == 1, f"{len(found)} {DETAILS_KEY} trailers"
        value = found[0]
        status = status_pb2.Status.FromString(value if isinstance(value, bytes) else b"")
        assert status.code == self.code.value[0], (status.code, self.code)
        assert status.message == self.details, (status.message, self.details)
        return status

    def error(self) -> DecodedError:
        status = self.status()
        assert status is not None, f"{self.code.name} without {DETAILS_KEY}: {self.details}"
        return decode_status(status)

    def answer(self, kind: type[Message]) -> Message:
        assert self.code == grpc.StatusCode.OK, f"{self.code.name}: {self.details}"
        assert len(self.messages) == 1, len(self.messages)
        return kind.FromString(self.messages[0])


def _code(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


def call_grpcio(address: str, call: Call) -> Outcome:
    """The call through grpcio's client, on a channel of its own."""
    compression = grpc.Compression.Gzip if call.gzip else None
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        kwargs = {"timeout": call.timeout_s, "metadata": call.metadata, "compression": compression}
        messages: list[bytes] = []
        if call.kind == "unary":
            method = channel.unary_unary(call.path)
            if call.cancel_after_s is not None:
                future = method.future(call.requests[0], **kwargs)
                time.sleep(call.cancel_after_s)
                future.cancel()
                return Outcome(future.code(), future.details() or "", [])
            try:
                answer, rpc = method.with_call(call.requests[0], **kwargs)
            except grpc.RpcError as error:
                return Outcome(error.code(), error.details() or "", [], _pairs(error))  # type: ignore[attr-defined]
            return Outcome(rpc.code(), rpc.details() or "", [answer], _pairs(rpc))
        cancelled = threading.Event()
        if call.kind == "server":
            stream = channel.unary_stream(call.path)(call.requests[0], **kwargs)
        else:
            stream = channel.stream_stream(call.path)(_held(call, cancelled), **kwargs)
        with contextlib.suppress(grpc.RpcError):  # the code says it
            for message in stream:
                messages.append(message)
                if len(messages) == call.cancel_after_answers:
                    stream.cancel()
                    break
        cancelled.set()
        return Outcome(stream.code(), stream.details() or "", messages, _pairs(stream))


def _held(call: Call, cancelled: threading.Event) -> Iterator[bytes]:
    """The call's messages; a stream to be cancelled keeps its side open until then."""
    yield from call.requests
    if call.cancel_after_answers is not None:
        cancelled.wait(30)


def _pairs(rpc: object) -> list[tuple[str, str | bytes]]:
    return [(key, value) for key, value in rpc.trailing_metadata() or ()]  # type: ignore[attr-defined]


def call_grpc_js(node: str, address: str, calls: list[Call]) -> list[Outcome]:
    """The calls through grpc-js's client, one after another in one Node process."""
    specs = [
        {
            "kind": call.kind,
            "path": call.path,
            "requests": [base64.b64encode(message).decode() for message in call.requests],
            "metadata": [[key, _text(value)] for key, value in call.metadata],
            "timeout_ms": None if call.timeout_s is None else call.timeout_s * 1000,
            "gzip": call.gzip,
            "cancel_after_ms": None if call.cancel_after_s is None else call.cancel_after_s * 1000,
            "cancel_after_answers": call.cancel_after_answers,
        }
        for call in calls
    ]
    ran = subprocess.run(
        [node, str(SCRIPT)],
        input=json.dumps({"address": address, "calls": specs}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"grpc_js_calls.mjs failed:\n{ran.stdout}\n{ran.stderr}"
    return [
        Outcome(
            _code(found["code"]),
            found["details"],
            [base64.b64decode(message) for message in found["messages"]],
            [
                (key, base64.b64decode(value) if key.endswith("-bin") else value)
                for key, value in found["trailers"]
            ],
        )
        for found in json.loads(ran.stdout)
    ]


def _text(value: str | bytes) -> str:
    return base64.b64encode(value).decode() if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- the calls


def pool(**fields: object) -> Call:
    return Call(f"{SERVICE}/Pool", (pb.PoolRequest(**fields).SerializeToString(),))


def texts(*items: str) -> pb.TextInput:
    return pb.TextInput(texts=list(items))


def stream_message(request_id: str, text: str) -> bytes:
    request = pb.PoolRequest(request_id=request_id, embed=texts(text))
    return pb.PoolStreamRequest(request=request).SerializeToString()


def with_padding(size: int) -> bytes:
    """An embed request of `size` bytes: one text and an unknown field of padding, which
    protobuf keeps and the server ignores (field 1000, length-delimited)."""
    head = pb.PoolRequest(embed=texts("padded")).SerializeToString()
    tag = _varint(1000 << 3 | 2)
    for length_bytes in range(1, 5):
        body = size - len(head) - len(tag) - length_bytes
        length = _varint(body)
        if len(length) == length_bytes:
            return head + tag + length + b"p" * body
    raise AssertionError(size)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


HEALTH = "/grpc.health.v1.Health"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
BIN_VALUES = (b"\x00\xff\x10", b"\xfe", b", =\x00")  # base64 with and without padding


CALLS: dict[str, Call] = {
    # Every PoolingService method, and every input case of Pool.
    "embed": pool(request_id="e", embed=texts("a door", "in front")),
    "classify": pool(model="classifier", classify=texts("good", "bad")),
    "score": pool(model="cross", score=pb.ScoreInput(text_1=["q"], text_2=["a", "b", "c"])),
    "token_embed": pool(token_embed=texts("every token")),
    "token_classify": pool(model="ner", token_classify=texts("Ada in London")),
    "embed_sparse": pool(model="splade", embed_sparse=pb.SparseInput(texts=["s"], top_k=5)),
    "stream": Call(
        f"{SERVICE}/PoolStream",
        (
            stream_message("s0", "one"),
            stream_message("s1", "two"),
            pb.PoolStreamRequest(request=pb.PoolRequest(request_id="bad")).SerializeToString(),
        ),
        kind="bidi",
    ),
    "list_models": Call(f"{SERVICE}/ListModels", (pb.ListModelsRequest().SerializeToString(),)),
    "tokenize": Call(
        f"{SERVICE}/Tokenize", (pb.TokenizeRequest(texts=["naïve café"]).SerializeToString(),)
    ),
    "rerank": Call(
        f"{SERVICE}/Rerank",
        (pb.RerankRequest(model="cross", query="q", documents=["x", "y"]).SerializeToString(),),
    ),
    "health": Call(
        f"{HEALTH}/Check", (health_pb2.HealthCheckRequest().SerializeToString(),), metadata=()
    ),
    "health_service": Call(
        f"{HEALTH}/Check",
        (health_pb2.HealthCheckRequest(service="pooling.v1.PoolingService").SerializeToString(),),
        metadata=(),
    ),
    "watch": Call(
        f"{HEALTH}/Watch",
        (health_pb2.HealthCheckRequest().SerializeToString(),),
        kind="server",
        metadata=(),
        cancel_after_answers=1,
    ),
    "reflection": Call(
        REFLECTION,
        (
            reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString(),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="pooling.v1.PoolingService"
            ).SerializeToString(),
        ),
        kind="bidi",
        metadata=(),
    ),
    # Each status code the server gives.
    "invalid_argument": pool(embed=texts("x"), params=pb.PoolingParams(dimensions=7)),
    "not_found": pool(model="no-such-model", embed=texts("x")),
    "failed_precondition": pool(classify=texts("the embedder cannot classify")),
    "queue_full": pool(embed=texts(*["q"] * (MAX_QUEUED + 1))),
    "internal": pool(model="broken", embed=texts("zebra giraffe")),
    "unauthenticated": Call(f"{SERVICE}/Pool", pool(embed=texts("x")).requests, metadata=()),
    "unimplemented": Call(f"{SERVICE}/NoSuchMethod", (b"",)),
    "unknown_service": Call(
        f"{HEALTH}/Check",
        (health_pb2.HealthCheckRequest(service="no.such.Service").SerializeToString(),),
        metadata=(),
    ),
    # Deadlines and cancellation.
    "deadline": Call(
        f"{SERVICE}/Pool",
        pool(
            embed=texts(*[LONG_TEXT] * 64), params=pb.PoolingParams(truncate_prompt_tokens=-1)
        ).requests,
        timeout_s=0.001,
    ),
    "cancel_unary": Call(
        f"{SERVICE}/Pool",
        pool(
            embed=texts(*[LONG_TEXT] * 64), params=pb.PoolingParams(truncate_prompt_tokens=-1)
        ).requests,
        cancel_after_s=0.005,  # well before 64 texts are even tokenized
    ),
    "cancel_stream": Call(
        f"{SERVICE}/PoolStream",
        (stream_message("c0", "answered before the cancel"),),
        kind="bidi",
        cancel_after_answers=1,
    ),
    "after_cancel": pool(embed=texts("the server goes on")),
    # Compression: gzip requests (answers are gzip too: --gzip-responses).
    "gzip": Call(
        f"{SERVICE}/Pool",
        pool(embed=texts("z " * 2000), params=pb.PoolingParams(truncate_prompt_tokens=-1)).requests,
        gzip=True,
    ),
    "gzip_over_cap": Call(f"{SERVICE}/Pool", (with_padding(MAX_MESSAGE + 1024),), gzip=True),
    # Metadata: repeated keys keep their values and order, -bin values their bytes.
    # (grpcio's client only: grpc-js refuses to send authorization twice.)
    "repeated_auth": Call(
        f"{SERVICE}/Pool",
        pool(embed=texts("x")).requests,
        metadata=(*AUTH, ("authorization", "Bearer not-the-key")),
    ),
    "repeated_auth_wrong_first": Call(
        f"{SERVICE}/Pool",
        pool(embed=texts("x")).requests,
        metadata=(("authorization", "Bearer not-the-key"), *AUTH),
    ),
    "repeated_bin": Call(
        f"{SERVICE}/Pool",
        pool(embed=texts("x")).requests,
        metadata=(
            *AUTH,
            *(("x-blob-bin", value) for value in BIN_VALUES),
            ("x-note", "one"),
            ("x-note", "two, three"),
        ),
    ),
    # Messages near the cap and over it.
    "near_cap": Call(f"{SERVICE}/Pool", (with_padding(MAX_MESSAGE - 1024),)),
    "over_cap": Call(f"{SERVICE}/Pool", (with_padding(MAX_MESSAGE + 1024),)),
    "answer_near_cap": pool(
        token_embed=texts(*[LONG_TEXT] * 40), params=pb.PoolingParams(truncate_prompt_tokens=-1)
    ),
    "answer_over_cap": pool(
        token_embed=texts(*[LONG_TEXT] * MAX_BATCH),
        params=pb.PoolingParams(truncate_prompt_tokens=-1),
    ),
}


@pytest.fixture(scope="module")
def js_outcomes(
    servers: dict[tuple[str, str], ServerProcess],
) -> Callable[[str], dict[str, Outcome]]:
    """Every call in CALLS through grpc-js against a door: one Node process per door, run
    on first use."""
    done: dict[str, dict[str, Outcome]] = {}

    def outcomes(door: str) -> dict[str, Outcome]:
        if door not in done:
            node, npm = _require_node()
            install_node_modules(npm)
            address = door_server(servers, door).address
            names = [name for name in CALLS if not name.startswith("repeated_auth")]
            found = call_grpc_js(node, address, [CALLS[name] for name in names])
            done[door] = dict(zip(names, found, strict=True))
        return done[door]

    return outcomes


@dataclass
class Via:
    door: str
    client: str
    server: ServerProcess
    js: Callable[[str], dict[str, Outcome]]

    def __call__(self, name: str) -> Outcome:
        if self.client == "grpc-js":
            return self.js(self.door)[name]
        return call_grpcio(self.server.address, CALLS[name])


@pytest.fixture(params=[(d, c) for d in DOORS for c in CLIENTS], ids=lambda p: f"{p[0]}-{p[1]}")
def via(
    request: pytest.FixtureRequest,
    servers: dict[tuple[str, str], ServerProcess],
    js_outcomes: Callable[[str], dict[str, Outcome]],
) -> Via:
    door, client = request.param
    return Via(door, client, door_server(servers, door), js_outcomes)


# --------------------------------------------------------------------------- every method


def test_every_pooling_method_answers(via: Via) -> None:
    embed = via("embed").answer(pb.PoolResponse)
    assert embed.request_id == "e" and embed.model == "embedder"
    assert [e.dimensions or len(e.values) for e in embed.embed.embeddings] == [32, 32]
    classify = via("classify").answer(pb.PoolResponse).classify.classifications
    assert [len(c.probs) for c in classify] == [3, 3] and all(c.label for c in classify)
    assert len(via("score").answer(pb.PoolResponse).score.scores) == 3
    [matrix] = via("token_embed").answer(pb.PoolResponse).token_embed.items
    assert matrix.rows == len(matrix.token_ids) > 2 and len(matrix.values) == 32 * matrix.rows
    [tagged] = via("token_classify").answer(pb.PoolResponse).token_classify.items
    assert len(tagged.labels) == tagged.rows > 2
    [sparse] = via("embed_sparse").answer(pb.PoolResponse).embed_sparse.embeddings
    assert len(sparse.indices) == len(sparse.values) == 5
    stream = via("stream")
    assert stream.code == grpc.StatusCode.OK, f"{stream.code.name}: {stream.details}"
    answers = {a.request_id: a for a in map(pb.PoolStreamResponse.FromString, stream.messages)}
    assert sorted(answers) == ["bad", "s0", "s1"], sorted(answers)
    assert all(answers[i].WhichOneof("result") == "response" for i in ("s0", "s1"))
    in_band = decode_status(answers["bad"].error)  # a request with no input, in-band
    assert in_band.code == grpc.StatusCode.INVALID_ARGUMENT, in_band
    assert in_band.info is not None and in_band.info.domain == DOMAIN, in_band
    models = via("list_models").answer(pb.ListModelsResponse)
    assert [card.name for card in models.models][:1] == ["embedder"]
    assert models.max_client_batch_size == MAX_BATCH
    [tokens] = via("tokenize").answer(pb.TokenizeResponse).items
    assert tokens.tokens[1:3] == ["naive", "cafe"], tokens.tokens
    ranked = via("rerank").answer(pb.RerankResponse).results
    assert sorted(r.index for r in ranked) == [0, 1]


def test_health_watch_and_reflection(via: Via) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert via("health").answer(health_pb2.HealthCheckResponse).status == serving
    assert via("health_service").answer(health_pb2.HealthCheckResponse).status == serving
    unknown = via("unknown_service")
    assert unknown.code == grpc.StatusCode.NOT_FOUND, f"{unknown.code.name}: {unknown.details}"
    watch = via("watch")  # a server stream that never ends: the client cancels it
    assert watch.code == grpc.StatusCode.CANCELLED, f"{watch.code.name}: {watch.details}"
    statuses = [health_pb2.HealthCheckResponse.FromString(m).status for m in watch.messages]
    assert statuses[:1] == [serving], statuses
    reflection = via("reflection")
    assert reflection.code == grpc.StatusCode.OK, f"{reflection.code}: {reflection.details}"
    listed, described = map(reflection_pb2.ServerReflectionResponse.FromString, reflection.messages)
    names = {service.name for service in listed.list_services_response.service}
    assert {"pooling.v1.PoolingService", "grpc.health.v1.Health"} <= names, names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(data)
        for data in described.file_descriptor_response.file_descriptor_proto
    ]
    assert "pooling/v1/pooling.proto" in {f.name for f in files}, [f.name for f in files]


# --------------------------------------------------------------------------- status codes

# The call, its code, and its ErrorInfo reason (None: a transport status, with no details
# required; any it has must still agree with the call's code and message).
STATUS_CASES = {
    "invalid_argument": (grpc.StatusCode.INVALID_ARGUMENT, "DIMENSIONS_NOT_SUPPORTED"),
    "not_found": (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND"),
    "failed_precondition": (grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED"),
    "queue_full": (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL"),
    "internal": (grpc.StatusCode.INTERNAL, "FORWARD_FAILED"),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, None),
    "unimplemented": (grpc.StatusCode.UNIMPLEMENTED, None),
    "over_cap": (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
}


@pytest.mark.parametrize("case", list(STATUS_CASES))
def test_each_status_code_with_its_details(via: Via, case: str) -> None:
    code, reason = STATUS_CASES[case]
    outcome = via(case)
    assert outcome.code == code, f"{case}: {outcome.code.name} ({outcome.details}), not {code.name}"
    assert outcome.details, f"{case}: {code.name} without a message"
    if reason is None:
        outcome.status()  # if present, intact and agreeing
        return
    error = outcome.error()
    assert error.info is not None, f"{case}: no ErrorInfo"
    assert (error.info.domain, error.reason) == (DOMAIN, reason), error.info
    if case == "invalid_argument":
        assert error.fields == ["params.dimensions"], error.fields
    if case == "queue_full":
        assert error.retry is not None or error.info.metadata, "QUEUE_FULL says when to retry"


# --------------------------------------------------------------------------- deadlines, cancels


def test_deadlines_and_cancellation(via: Via) -> None:
    """A passed deadline is DEADLINE_EXCEEDED; a cancelled unary call or stream is
    CANCELLED (a stream keeps the answers it had); the server serves on, untroubled."""
    via("embed")  # grpc-js's script makes every call at once (the failing model's too): first
    log_start = len(via.server.log())
    deadline = via("deadline")
    assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED, (deadline.code, deadline.details)
    assert via("cancel_unary").code == grpc.StatusCode.CANCELLED
    stream = via("cancel_stream")
    assert stream.code == grpc.StatusCode.CANCELLED, f"{stream.code.name}: {stream.details}"
    assert [pb.PoolStreamResponse.FromString(m).request_id for m in stream.messages] == ["c0"]
    assert len(via("after_cancel").answer(pb.PoolResponse).embed.embeddings) == 1
    assert "Traceback" not in via.server.log()[log_start:]


@pytest.mark.parametrize("door", DOORS)
def test_the_server_ends_a_call_at_its_deadline(servers: Servers, door: str) -> None:
    """A call whose message never ends, with grpc-timeout 300m: the server itself answers
    DEADLINE_EXCEEDED (no client timer is running on a bare connection)."""
    server = door_server(servers, door)
    with Wire(server.port) as wire:
        started = time.monotonic()
        stream = wire.open("Pool", (*AUTH, ("grpc-timeout", "300m")))
        wire.send(stream, frame(pool(embed=texts("never ends")).requests[0])[:8])
        wire.wait([stream], 10)
        took = time.monotonic() - started
        found = wire.calls[stream]
    assert found.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], (
        f"--grpc-door {door}: a call past its 300 ms deadline got {found.outcome()} "
        f"after {took:.1f}s"
    )
    assert took < 5, f"--grpc-door {door}: DEADLINE_EXCEEDED only after {took:.1f}s"


# --------------------------------------------------------------------------- compression


def test_gzip_requests(via: Via) -> None:
    """A gzip request is served; one that inflates past the cap is RESOURCE_EXHAUSTED."""
    assert len(via("gzip").answer(pb.PoolResponse).embed.embeddings) == 1
    over = via("gzip_over_cap")
    assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{over.code.name}: {over.details}"


@pytest.mark.parametrize("door", DOORS)
def test_gzip_responses_only_when_asked(servers: Servers, door: str) -> None:
    """--gzip-responses: answers to a client accepting gzip are gzip (flag and header);
    without the flag (the edge server) they are not."""
    # A repetitive answer: gzip makes it smaller, so a server has no cause to send it plain.
    body = frame(pb.TokenizeRequest(texts=["compress me " * 40]).SerializeToString())
    accept = (*AUTH, ("grpc-accept-encoding", "gzip"))
    seen = {}
    for role in ("main", "edge"):
        with Wire(door_server(servers, door, role).port) as wire:
            stream = wire.start("Tokenize", body, accept)
            wire.wait([stream], 30)
            seen[role] = wire.calls[stream]
    on, off = seen["main"], seen["edge"]
    assert on.grpc_status == off.grpc_status == 0, (on.outcome(), off.outcome())
    assert on.headers.get("grpc-encoding") == "gzip", on.headers
    assert on.data[:1] == b"\x01", "--gzip-responses: the answer's message is not compressed"
    answer = pb.TokenizeResponse.FromString(gzip.decompress(on.data[5:]))
    assert len(answer.items[0].token_ids) == 122
    assert off.headers.get("grpc-encoding", "identity") == "identity", off.headers
    assert off.data[:1] == b"\x00"


# --------------------------------------------------------------------------- metadata


def test_repeated_and_binary_metadata(via: Via) -> None:
    """Repeated keys arrive as separate values in order (the first Bearer authorization
    decides, so a joined "a, b" would lock the caller out); repeated -bin values do not
    break the call; the timing trailers come once each, and the -bin status details of an
    error decode to the call's own status."""
    if via.client == "grpcio":  # grpc-js refuses to send two authorization values
        repeated = via("repeated_auth")
        assert repeated.code == grpc.StatusCode.OK, (
            f"two authorization values, the first right: {repeated.code.name} {repeated.details}"
        )
        wrong_first = via("repeated_auth_wrong_first")
        assert wrong_first.code == grpc.StatusCode.UNAUTHENTICATED, wrong_first.code
    binary = via("repeated_bin")
    assert binary.code == grpc.StatusCode.OK, f"repeated -bin: {binary.code.name} {binary.details}"
    for key in TIMING_KEYS:
        values = binary.values(key)
        assert len(values) == 1 and float(values[0]) >= 0, (key, values)
    error = via("invalid_argument").error()  # decoded from grpc-status-details-bin
    assert error.reason == "DIMENSIONS_NOT_SUPPORTED"


@pytest.mark.parametrize("door", DOORS)
def test_repeated_metadata_over_the_wire(servers: Servers, door: str) -> None:
    """Two authorization headers, as HTTP/2 lets any client send them: the first decides
    whichever the second is, so each must reach the server as its own value. Repeated -bin
    values beside them do not break the call."""
    server = door_server(servers, door)
    body = frame(EMBED)
    wrong = ("authorization", "Bearer not-the-key")
    blobs = (("x-blob-bin", "AP8Q"), ("x-blob-bin", "/g=="))
    with Wire(server.port) as wire:
        right_first = wire.start("Pool", body, (*AUTH, wrong, *blobs))
        wrong_first = wire.start("Pool", body, (wrong, *AUTH))
        wire.wait([right_first, wrong_first], 30)
        outcomes = (wire.calls[right_first].outcome(), wire.calls[wrong_first].outcome())
    assert outcomes[0].startswith("grpc-status 0 "), (
        f"--grpc-door {door}: the right key first, then a wrong one: {outcomes[0]}"
    )
    assert outcomes[1].startswith("grpc-status 16 "), (
        f"--grpc-door {door}: a wrong key first, then the right one: {outcomes[1]}"
    )


# --------------------------------------------------------------------------- message size


def test_messages_near_and_over_the_cap(via: Via) -> None:
    """--max-message-mb 1: a request 1 KiB under it is served, 1 KiB over it is
    RESOURCE_EXHAUSTED; an answer under it is sent, one over it is refused with details."""
    assert len(via("near_cap").answer(pb.PoolResponse).embed.embeddings) == 1
    over = via("over_cap")
    assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{over.code.name}: {over.details}"
    near = via("answer_near_cap")
    assert len(near.answer(pb.PoolResponse).token_embed.items) == 40
    assert MAX_MESSAGE // 2 < len(near.messages[0]) <= MAX_MESSAGE, len(near.messages[0])
    refused = via("answer_over_cap")
    assert refused.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), (
        f"an answer over the cap: {refused.code.name} {refused.details}"
    )
    assert refused.error().reason == "OUTPUT_TOO_LARGE", refused.error().reason


# --------------------------------------------------------------------------- bare HTTP/2


class _GoawayTolerant(h2.connection.H2Connection):
    """h2 closes its side on GOAWAY; a server's GOAWAY still lets calls in flight finish,
    so this connection records it and stays open for them."""

    def _receive_goaway_frame(self, frame):  # type: ignore[no-untyped-def]
        state = self.state_machine.state
        frames, events = super()._receive_goaway_frame(frame)
        self.state_machine.state = state
        return frames, events


@dataclass
class WireCall:
    headers: dict[str, str] = field(default_factory=dict)  # headers and trailers
    data: bytes = b""
    ended: bool = False
    reset: int | None = None

    @property
    def grpc_status(self) -> int | None:
        status = self.headers.get("grpc-status")
        return None if status is None else int(status)

    def outcome(self) -> str:
        if self.grpc_status is not None:
            return f"grpc-status {self.grpc_status} ({self.headers.get('grpc-message', '')})"
        return "unanswered" if self.reset is None else f"RST_STREAM {self.reset}"


class Wire:
    """A bare HTTP/2 connection that speaks just enough gRPC to send what clients never do."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = _GoawayTolerant(config)
        self.conn.initiate_connection()
        self.calls: dict[int, WireCall] = {}
        self.goaways: list[h2.events.ConnectionTerminated] = []
        self.closed = False
        self.flush()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.sock.sendall(data)

    def open(self, method: str, metadata: Metadata = AUTH) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"{SERVICE}/{method}"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.conn.send_headers(stream_id, headers)
        self.calls[stream_id] = WireCall()
        self.flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self.conn.send_data(stream_id, data, end_stream=end)
        self.flush()

    def start(self, method: str, body: bytes, metadata: Metadata = AUTH) -> int:
        stream_id = self.open(method, metadata)
        self.send(stream_id, body, end=True)
        return stream_id

    def ping(self) -> None:
        self.conn.ping(b"12345678")
        self.flush()

    def pump(self, timeout: float) -> None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return
        except ConnectionError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            call = self.calls.get(getattr(event, "stream_id", 0) or 0)
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                if call is not None:
                    call.headers.update(event.headers)  # type: ignore[arg-type]
            elif isinstance(event, h2.events.DataReceived):
                if call is not None:
                    call.data += event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and call is not None:
                call.ended = True
            elif isinstance(event, h2.events.StreamReset) and call is not None:
                call.reset = int(event.error_code)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaways.append(event)
        self.flush()

    def wait(self, stream_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.closed:
            if all(self.calls[s].ended or self.calls[s].reset is not None for s in stream_ids):
                return
            self.pump(deadline - time.monotonic())

    def wait_goaway(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.goaways and not self.closed and time.monotonic() < deadline:
            self.pump(deadline - time.monotonic())


def frame(message: bytes, compressed: bool = False) -> bytes:
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


EMBED = pool(embed=texts("raw")).requests[0]
MALFORMED: dict[str, tuple[Metadata, bytes]] = {
    "message cut short": ((), frame(EMBED)[:-3]),
    "grpc-timeout 1x": ((("grpc-timeout", "1x"),), frame(EMBED)),
    "grpc-timeout -1S": ((("grpc-timeout", "-1S"),), frame(EMBED)),
    "grpc-timeout 1.5S": ((("grpc-timeout", "1.5S"),), frame(EMBED)),
    "grpc-timeout empty": ((("grpc-timeout", ""),), frame(EMBED)),
    "grpc-timeout nine digits": ((("grpc-timeout", "123456789S"),), frame(EMBED)),
    "corrupt gzip": (
        (("grpc-encoding", "gzip"),),
        frame(gzip.compress(EMBED)[:12] + b"\x00garbage\xff" * 4, compressed=True),
    ),
}
# gRPC core answers these itself, before any of grpcio's Python code sees the call (INTERNAL):
# the grpcio door cannot change it, which is one reason the default door is the Node one.
GRPC_CORE_ANSWERS = {case for case in MALFORMED if case.startswith("grpc-timeout")} | {
    "corrupt gzip"
}


@pytest.mark.parametrize("door", DOORS)
def test_malformed_input_is_invalid_argument_never_internal(servers: Servers, door: str) -> None:
    """What a broken or hostile client sends is its fault, not the server's: each case is
    INVALID_ARGUMENT (on grpcio, those that reach the door at all)."""
    server = door_server(servers, door)
    cases = {
        case: sent
        for case, sent in MALFORMED.items()
        if door != "grpcio" or case not in GRPC_CORE_ANSWERS
    }
    outcomes = {}
    with Wire(server.port) as wire:
        streams = {
            case: wire.start("Pool", body, (*AUTH, *metadata))
            for case, (metadata, body) in cases.items()
        }
        wire.wait(list(streams.values()), 10)
        outcomes = {case: wire.calls[stream] for case, stream in streams.items()}
    wrong = {
        case: call.outcome()
        for case, call in outcomes.items()
        if call.grpc_status != grpc.StatusCode.INVALID_ARGUMENT.value[0]
    }
    assert not wrong, f"--grpc-door {door}: not INVALID_ARGUMENT: {wrong}"


# --------------------------------------------------------------------------- keepalive


@pytest.mark.parametrize("door", DOORS)
def test_a_client_pinging_too_often_is_sent_goaway(servers: Servers, door: str) -> None:
    """--min-client-ping-interval-s (10 s by default): a connection that pings every
    50 ms with no call is sent GOAWAY ENHANCE_YOUR_CALM (too_many_pings), and only it."""
    server = door_server(servers, door)
    with Wire(server.port) as wire:
        deadline = time.monotonic() + 3
        pings = 0
        while not wire.goaways and not wire.closed and time.monotonic() < deadline:
            wire.ping()
            pings += 1
            paced = time.monotonic() + 0.05
            while time.monotonic() < paced and not wire.goaways:
                wire.pump(paced - time.monotonic())
        codes = [int(event.error_code) for event in wire.goaways]
    assert ENHANCE_YOUR_CALM in codes, (
        f"--grpc-door {door}: {pings} pings in 3 s got GOAWAY codes {codes}"
        f"{' and a closed connection' if wire.closed else ''}, not ENHANCE_YOUR_CALM"
    )
    assert call_grpcio(server.address, CALLS["embed"]).code == grpc.StatusCode.OK


# --------------------------------------------------------------------------- age and drain


@pytest.mark.parametrize("door", DOORS)
def test_connection_age_sends_goaway_and_calls_in_flight_finish(
    servers: Servers, door: str
) -> None:
    """--max-connection-age-s 1: the connection is sent GOAWAY; a stream open across it
    still sends its next message, gets its answer and ends OK within the grace."""
    server = door_server(servers, door, "edge")
    with Wire(server.port) as wire:
        stream = wire.open("PoolStream")
        wire.send(stream, frame(stream_message("before", "sent before the GOAWAY")))
        wire.wait_goaway(AGE_S * 1.2 + 4)
        goaways = [(int(e.error_code), e.last_stream_id) for e in wire.goaways]
        assert goaways, f"--grpc-door {door}: no GOAWAY within {AGE_S * 1.2 + 4:.1f}s of age"
        wire.send(stream, frame(stream_message("after", "sent after the GOAWAY")), end=True)
        wire.wait([stream], 15)
        call = wire.calls[stream]
    assert call.grpc_status == 0, f"--grpc-door {door}: the stream got {call.outcome()}"
    answered = sorted(pb.PoolStreamResponse.FromString(m).request_id for m in _messages(call.data))
    assert answered == ["after", "before"], answered
    assert goaways[0][0] == 0, f"GOAWAY {goaways}: not NO_ERROR"


def _messages(data: bytes) -> list[bytes]:
    found = []
    while data:
        length = int.from_bytes(data[1:5], "big")
        found.append(data[5 : 5 + length])
        data = data[5 + length :]
    return found


@pytest.mark.parametrize("door", DOORS)
def test_drain_finishes_calls_in_flight_and_refuses_new_ones(servers: Servers, door: str) -> None:
    """SIGTERM: a stream open before it sends on and is answered, a unary call whose body
    was half sent completes, new calls are refused (UNAVAILABLE) or served, never hung,
    and the server exits 0. Ends the edge server: the module's last test on it."""
    server = door_server(servers, door, "edge")
    outbox: queue.Queue[bytes | None] = queue.Queue()
    outbox.put(stream_message("s0", "before the drain"))
    with grpc.insecure_channel(server.address) as channel, Wire(server.port) as wire:
        call = channel.stream_stream(f"{SERVICE}/PoolStream")(
            iter(outbox.get, None), metadata=AUTH, timeout=30
        )
        first = pb.PoolStreamResponse.FromString(next(call))
        body = frame(pool(embed=texts("half before, half after")).requests[0])
        unary = wire.open("Pool")
        wire.send(unary, body[:10])
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        wire.send(unary, body[10:], end=True)
        outbox.put(stream_message("s1", "after the drain began"))
        outbox.put(None)
        rest = [pb.PoolStreamResponse.FromString(m) for m in call]
        wire.wait([unary], 15)
        half = wire.calls[unary]
        late = call_grpcio(server.address, replace_timeout(CALLS["embed"], 5))
    assert first.request_id == "s0"
    assert [r.request_id for r in rest] == ["s1"], f"--grpc-door {door}: {rest}"
    assert call.code() == grpc.StatusCode.OK, call.code()
    assert half.grpc_status == 0, f"--grpc-door {door}: the half-sent call got {half.outcome()}"
    assert late.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK), (
        f"--grpc-door {door}: a call after SIGTERM got {late.code.name}: {late.details}"
    )
    assert server.process.wait(30) == 0, server.log()[-3000:]


def replace_timeout(call: Call, timeout_s: float) -> Call:
    return Call(call.path, call.requests, call.kind, call.metadata, timeout_s, call.gzip)
