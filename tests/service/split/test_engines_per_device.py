"""--engines-per-device K: several engine processes on one device, and the stall check.

A real split server (one front end, two engine processes sharing the CPU as they would
share a GPU) on real ports. Engines are frozen with SIGSTOP to stand for a wedged one: the
front end's stall check (--engine-stall-s) must route around it, report NOT_SERVING only
while no engine can serve, lose no call once it thaws, and kill one that never comes back.
Tests run in file order on one module server; the last one leaves one engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import Served, server_args
from tests.metrics_endpoint import metric_sum
from tests.responses import assert_same_response
from tests.rpc_errors import decode_rpc_error
from tests.service.split.test_frontends import (
    WAIT_S,
    Delta,
    Split,
    phrase,
    start_split,
    stop_split,
    text_request,
    wait_for,
)

Stub = pooling_pb2_grpc.PoolingServiceStub
STALL_S = 1.0
KILLED_AFTER_S = 6 * STALL_S  # engine/scheduling/remote_client.py's STALL_KILL_FACTOR
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MODELS = ("tiny-bert", "tiny-classifier", "tiny-cross-encoder", "tiny-ner")


@pytest.fixture(scope="module")
def k2(served: dict[str, Served], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    args = [*server_args([served[name] for name in MODELS]), "--dtype", "float32"]
    args += ["--engines-per-device", "2", "--engine-stall-s", str(STALL_S)]
    split = start_split(args, tmp_path_factory.mktemp("k2"), "k2", frontends=1)
    yield split
    stop_split(split)


@pytest.fixture(scope="module")
def k2_stub(k2: Split) -> Iterator[Stub]:
    with grpc.insecure_channel(k2.server.address) as channel:
        yield Stub(channel)


def requests(prefix: str, count: int) -> list[pb.PoolRequest]:
    """Every model's tasks, one to three texts each."""
    made = []
    for i in range(count):
        texts = [phrase(i, k) for k in range(1 + i % 3)]
        rid = f"{prefix}-{i}"
        kind = i % 4
        if kind == 0:
            made.append(text_request("embed", rid, texts))
        elif kind == 1:
            made.append(text_request("classify", rid, texts, "tiny-classifier"))
        elif kind == 2:
            score = pb.ScoreInput(text_1=["where is the mill"], text_2=texts)
            made.append(pb.PoolRequest(request_id=rid, model="tiny-cross-encoder", score=score))
        else:
            made.append(text_request("token_classify", rid, texts, "tiny-ner"))
    return made


def health(split: Split) -> int | None:
    try:
        return split.server.health(timeout=2)
    except grpc.RpcError:
        return None


def stalled(split: Split, engine: int) -> float:
    """1 while the front end sees `engine` stalled."""
    return metric_sum(split.scrape(), "pooling_engine_stalled", engine=str(engine))


def embed(stub: Stub, rid: str, timeout: float = WAIT_S) -> grpc.Future:
    return stub.Pool.future(text_request("embed", rid, [phrase(len(rid))]), timeout=timeout)


def test_two_engines_answer_as_one_engine_does(k2_stub: Stub, stub: Stub) -> None:
    """The shared one-engine server is the reference: same models, same dtype."""
    sent = requests("parity", 24)
    want = [stub.Pool(request, timeout=WAIT_S) for request in sent]
    burst = [k2_stub.Pool.future(request, timeout=WAIT_S) for request in sent]
    for future, expected in zip(burst, want, strict=True):
        assert_same_response(future.result(), expected)


def test_list_models_and_metrics_count_each_engine_once(k2: Split, k2_stub: Stub) -> None:
    cards = k2_stub.ListModels(pb.ListModelsRequest(), timeout=WAIT_S).models
    assert {card.name: card.engines_per_device for card in cards} == dict.fromkeys(MODELS, 2)
    samples = k2.scrape()
    engines = {s.labels["device"]: s.value for s in samples["pooling_engines"]}
    assert engines == {"cpu": 2.0}
    calls = 20
    delta = Delta(k2)
    for future in [embed(k2_stub, f"count-{i}") for i in range(calls)]:
        future.result()
    assert wait_for(lambda: delta("pooling_batch_size_sum", model="tiny-bert") >= calls, 5)
    assert delta("pooling_batch_size_sum", model="tiny-bert") == calls  # each item once
    assert delta("pooling_requests_total", code="OK") == calls


def test_a_stalled_engine_is_routed_around_and_loses_nothing(k2: Split, k2_stub: Stub) -> None:
    first, second = k2.processes("engine")
    first.suspend()
    try:
        # Sent before the stall shows: the jobs alternate, so some wait on the frozen one.
        early = [embed(k2_stub, f"early-{i}") for i in range(6)]
        assert wait_for(lambda: sum(f.done() for f in early) >= 2, 10)
        assert not all(f.done() for f in early), "no job went to the frozen engine"
        assert wait_for(lambda: stalled(k2, 0) == 1, STALL_S + 2), k2.server.log()[-2000:]
        assert health(k2) == SERVING  # the other engine serves
        # Once stalled, new calls go around it and finish while it is still frozen.
        late = [embed(k2_stub, f"late-{i}") for i in range(6)]
        for future in late:
            assert future.result(timeout=10).HasField("embed")
        waiting = sum(not f.done() for f in early)
    finally:
        first.resume()
    assert waiting
    for future in early:  # nothing lost: the thawed engine answers what it held
        assert future.result(timeout=WAIT_S).HasField("embed")
    assert wait_for(lambda: stalled(k2, 0) == 0, 5)
    assert second.is_running()


def test_no_engine_serving_is_not_serving_until_one_answers(k2: Split, k2_stub: Stub) -> None:
    engines = k2.processes("engine")
    started = time.monotonic()
    for engine in engines:
        engine.suspend()
    try:
        assert wait_for(lambda: health(k2) == NOT_SERVING, STALL_S + 1.5)
        noticed = time.monotonic() - started
        held = embed(k2_stub, "held")  # waits for an engine to come back
        time.sleep(0.3)
        assert not held.done()
    finally:
        for engine in engines:
            engine.resume()
    assert noticed < STALL_S + 1.5
    assert wait_for(lambda: health(k2) == SERVING, 5)
    assert held.result(timeout=WAIT_S).HasField("embed")


def test_an_engine_that_never_comes_back_is_killed_and_the_other_serves_on(
    k2: Split, k2_stub: Stub
) -> None:
    """Stalled 6 x --engine-stall-s: killed; its calls fail ENGINE_DEAD, the rest go on."""
    first, second = k2.processes("engine")
    delta = Delta(k2)
    second.suspend()
    try:
        sent = [embed(k2_stub, f"lost-{i}") for i in range(6)]
        assert wait_for(lambda: not second.is_running(), KILLED_AFTER_S + 10)
    finally:
        if second.is_running():
            second.resume()
    outcomes = []
    for future in sent:
        error = future.exception(timeout=WAIT_S)
        outcomes.append("ok" if error is None else decode_rpc_error(error))  # type: ignore[arg-type]
    lost = [o for o in outcomes if o != "ok"]
    assert lost and len(lost) < len(sent), outcomes
    for error in lost:
        assert error.code == grpc.StatusCode.UNAVAILABLE, error
        assert error.reason == "ENGINE_DEAD", error
    # The server serves on with the other engine.
    assert k2.server.process.poll() is None
    assert health(k2) == SERVING
    for future in [embed(k2_stub, f"after-{i}") for i in range(6)]:
        assert future.result(timeout=WAIT_S).HasField("embed")
    assert first.is_running()
    assert wait_for(lambda: k2.scrape()["pooling_engines"][0].value == 1.0, 5)
    assert delta("pooling_engine_stalls", engine="1") >= 1
    assert "killing it" in k2.server.log()
