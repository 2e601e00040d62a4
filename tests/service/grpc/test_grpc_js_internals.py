"""The Node door's two promises about grpc-js and the errors table: every status it answers
with comes from the table (Python sends Node each reason's code at start), and the grpc-js
internals it wraps are checked by name, so a grpc-js whose private shapes changed stops the
door, saying which one, instead of serving calls wrongly."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pooling_server.engine.errors import ErrorKind
from pooling_server.service.errors import grpc_code_of
from pooling_server.service.grpc import node_door
from pooling_server.service.grpc.node_door import (
    CODES,
    REFUSALS,
    SCRIPT,
    HandlerSet,
    NodeDoor,
    unary_request_paths,
)
from pooling_server.service.ops.config import ServerConfig
from tests.reliability.test_attacks import RawHttp2, grpc_frame
from tests.server_process import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not node_door.installed(),
    reason="needs Node.js and service/grpc/node_modules (make node-door)",
)

G = grpc.StatusCode
NODE_MODULES = SCRIPT.with_name("node_modules")
GRPC_JS = NODE_MODULES / "@grpc" / "grpc-js" / "build" / "src"
CHECK_PATH = "/grpc.health.v1.Health/Check"


def _check(script: Path = SCRIPT) -> tuple[int, dict[str, object]]:
    done = subprocess.run(
        ["node", str(script), "--check-internals"], capture_output=True, text=True, timeout=60
    )
    return done.returncode, json.loads(done.stdout)


def test_the_installed_grpc_js_has_every_internal_the_door_relies_on() -> None:
    code, report = _check()
    assert (code, report["problems"]) == (0, [])
    assert (
        report["version"]
        == json.loads((SCRIPT.parent / "package.json").read_text())["dependencies"]["@grpc/grpc-js"]
    )


def test_every_wrapped_method_is_checked() -> None:
    """Each method of grpc-js's that node_door.mjs assigns over is in its check, and the
    docs' list of internals names it."""
    source = SCRIPT.read_text()
    wrapped = set(re.findall(r"^Base\.(\w+) = ", source, re.MULTILINE))
    wrapped |= {f"server.{name}" for name in re.findall(r"^server\.(\w+) = ", source, re.M)}
    assert wrapped >= {"handleTimeoutHeader", "decompressMessage", "server.createHttp2Server"}
    checked = set(re.findall(r"method\(proto, callName, '(\w+)'", source))
    checked |= {
        f"server.{n}" for n in re.findall(r"method\(grpc\.Server\.prototype, \w+, '(\w+)'", source)
    }
    assert wrapped <= checked
    docs = (Path(__file__).parents[3] / "docs" / "grpc-door.md").read_text()
    for name in wrapped:
        assert re.search(rf"`{name.removeprefix('server.')}[`(]", docs), name


@pytest.fixture(scope="module")
def grpc_js_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """node_door.mjs beside a copy of grpc-js that a test may change (its dependencies
    linked, not copied)."""
    root = tmp_path_factory.mktemp("grpc-js-copy")
    shutil.copy(SCRIPT, root / SCRIPT.name)
    shutil.copy(SCRIPT.with_name("package.json"), root / "package.json")
    modules = root / "node_modules"
    modules.mkdir()
    for entry in NODE_MODULES.iterdir():
        if entry.name != "@grpc":
            (modules / entry.name).symlink_to(entry)
    (modules / "@grpc").mkdir()
    (modules / "@grpc" / "proto-loader").symlink_to(NODE_MODULES / "@grpc" / "proto-loader")
    shutil.copytree(NODE_MODULES / "@grpc" / "grpc-js", modules / "@grpc" / "grpc-js")
    return root


@pytest.fixture
def changed_grpc_js(grpc_js_copy: Path) -> Iterator[tuple[Path, Path]]:
    """(the copy's node_door.mjs, the copy's build/src), the sources put back afterwards."""
    src = grpc_js_copy / "node_modules" / "@grpc" / "grpc-js" / "build" / "src"
    kept = {
        name: (src / name).read_text()
        for name in ("server-interceptors.js", "server.js", "stream-decoder.js")
    }
    yield grpc_js_copy / SCRIPT.name, src
    for name, text in kept.items():
        (src / name).write_text(text)


# (file in build/src, text, its replacement, the name the check must give)
CHANGES = [
    (
        "server-interceptors.js",
        "    handleDataFrame(data) {",
        "    handleDataFrame(data, flags) {",
        "BaseServerInterceptingCall.prototype.handleDataFrame",
    ),
    (
        "server-interceptors.js",
        "    handleEndEvent() {",
        "    handleStreamEnd() {",
        "BaseServerInterceptingCall.prototype.handleEndEvent",
    ),
    (
        "server-interceptors.js",
        "    decompressMessage(message, encoding) {",
        "    decompressMessage(message) { const encoding = this.incomingEncoding;",
        "BaseServerInterceptingCall.prototype.decompressMessage",
    ),
    (
        "server-interceptors.js",
        "this.incomingEncoding = 'identity';",
        "this.incomingEncoding = undefined;",
        "BaseServerInterceptingCall#incomingEncoding",
    ),
    (
        "stream-decoder.js",
        'ReadState["READING_MESSAGE"] = 2',
        'ReadState["READING_MESSAGE"] = 3',
        "BaseServerInterceptingCall#decoder.readState",
    ),
    (
        "server.js",
        "createHttp2Server(credentials) {",
        "createHttp2Server(credentials, port) {",
        "Server.prototype.createHttp2Server",
    ),
    (
        "server.js",
        "this.commonServerOptions.settings = {",
        "this.commonServerOptions.http2Settings = {",
        "Server#commonServerOptions",
    ),
]


@pytest.mark.parametrize(("file", "old", "new", "name"), CHANGES, ids=[c[3] for c in CHANGES])
def test_a_changed_internal_is_named_and_stops_the_door(
    changed_grpc_js: tuple[Path, Path], file: str, old: str, new: str, name: str
) -> None:
    script, src = changed_grpc_js
    text = (src / file).read_text()
    assert text.count(old) == 1, f"{file} no longer reads as the pinned version's"
    (src / file).write_text(text.replace(old, new))
    code, report = _check(script)
    assert code == 1
    assert any(str(problem).startswith(f"{name}:") for problem in report["problems"]), report
    # Starting the door runs the same check, before it reads its link or socket.
    done = subprocess.run(["node", str(script), "{}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and name in done.stderr, done.stderr


def test_no_status_is_written_by_hand_in_either_half() -> None:
    mjs = SCRIPT.read_text()
    assert not re.search(r"grpc\.status|Status\.[A-Z]|code: \d", mjs)
    used = set(re.findall(r"refus(?:al|e)\((?:call, )?'([A-Z_]+)'", mjs))
    assert len(used) >= 10 and used <= set(REFUSALS), used - set(REFUSALS)
    python = Path(node_door.__file__).read_text()
    assert set(re.findall(r"StatusCode\.([A-Z_]+)", python)) == {"OK"}  # success, no refusal


def test_each_refusal_has_the_tables_code() -> None:
    """Written out: what clients of the Node door see for each of its own refusals."""
    expected = {
        "TIMEOUT_MALFORMED": G.INVALID_ARGUMENT,
        "MESSAGE_CUT_SHORT": G.INVALID_ARGUMENT,
        "COMPRESSION_CORRUPT": G.INVALID_ARGUMENT,
        "COMPRESSED_WITHOUT_ENCODING": G.INTERNAL,  # gRPC's compression spec
        "ENCODING_UNSUPPORTED": G.UNIMPLEMENTED,
        "REQUEST_ENTITY_TOO_LARGE": G.RESOURCE_EXHAUSTED,
        "TOO_MANY_CALLS": G.RESOURCE_EXHAUSTED,
        "READ_TURN_TIMEOUT": G.RESOURCE_EXHAUSTED,
        "ANSWERS_UNREAD": G.RESOURCE_EXHAUSTED,
        "BODY_TIMEOUT": G.DEADLINE_EXCEEDED,
        "SERVER_STOPPED": G.UNAVAILABLE,
        "UNAUTHENTICATED": G.UNAUTHENTICATED,
        "CANCELLED": G.CANCELLED,
        "NOT_FOUND": G.UNIMPLEMENTED,  # grpc.aio's answer for an unknown method
        "MALFORMED_REQUEST": G.INVALID_ARGUMENT,
        "ONE_MESSAGE_EXPECTED": G.INVALID_ARGUMENT,
        "HANDLER_FAILED": G.UNKNOWN,  # grpc.aio's answer for a handler that raised
    }
    assert expected == CODES
    assert all(CODES[reason] is grpc_code_of(kind, reason) for reason, kind in REFUSALS.items())
    sent = NodeDoor(ServerConfig(), HandlerSet(), [])._settings(3, 4)["refusals"]
    assert sent == {reason: code.value[0] for reason, code in expected.items()}
    assert REFUSALS["HANDLER_FAILED"] is ErrorKind.INTERNAL


class _DoorThread:
    """A Node door serving grpc.health on a port, its loop in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.door = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self) -> NodeDoor:
        handlers = HandlerSet()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), handlers)
        whole = unary_request_paths(health_pb2.DESCRIPTOR.services_by_name["Health"])
        door = NodeDoor(ServerConfig(port=free_port()), handlers, whole)
        self.port = await door.start()
        return door

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.door.stop(1.0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_node_and_python_answer_with_the_codes_python_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With two reasons' codes changed in Python, Node's refusal (a malformed grpc-timeout)
    and Python's (a request that does not parse) both answer with the changed codes."""
    monkeypatch.setitem(CODES, "TIMEOUT_MALFORMED", G.ABORTED)
    monkeypatch.setitem(CODES, "MALFORMED_REQUEST", G.DATA_LOSS)
    served = _DoorThread()
    try:
        raw = RawHttp2(served.port)
        try:
            body = grpc_frame(health_pb2.HealthCheckRequest().SerializeToString())
            cases = {
                "timeout": raw.start(CHECK_PATH, body, (("grpc-timeout", "1.5S"),)),
                "parse": raw.start(CHECK_PATH, grpc_frame(b"\xff\xff\xff")),
                "fine": raw.start(CHECK_PATH, body),
            }
            raw.wait(list(cases.values()), 30)
            outcomes = {case: raw.calls[stream].outcome() for case, stream in cases.items()}
        finally:
            raw.close()
    finally:
        served.stop()
    assert outcomes == {
        "timeout": f"grpc-status {G.ABORTED.value[0]}",
        "parse": f"grpc-status {G.DATA_LOSS.value[0]}",
        "fine": "grpc-status 0",
    }
