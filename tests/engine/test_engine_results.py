"""An engine process's results message (engine/scheduling/core.py `_message`): outputs of any shape
and
dtype, and errors, come back to the front end as they went in."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.scheduling.core import _message
from pooling_server.engine.scheduling.ipc import OUTPUTS, Results, unpack_outputs
from pooling_server.engine.scheduling.jobs import Job


def test_outputs_and_errors_come_back_as_sent() -> None:
    loop = asyncio.new_event_loop()
    jobs = [Job([], list, loop.create_future(), key=key) for key in range(4)]
    loop.close()
    vector = np.arange(4, dtype=np.float32)
    rows = np.arange(6, dtype=np.float64).reshape(2, 3)  # token states, not float32
    error = PoolingError(ErrorKind.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "too late")
    answered = [
        (jobs[0], [vector]),
        (jobs[1], error),
        (jobs[2], [rows, vector[1:3]]),
        (jobs[3], []),
    ]
    header, data = _message(answered)
    assert data.dtype == OUTPUTS
    results = msgspec.msgpack.decode(header, type=Results).results
    assert [r.id for r in results] == [0, 1, 2, 3]
    offset = 0
    got = []
    for result in results:
        arrays, offset = unpack_outputs(data, offset, result.shapes)
        got.append(arrays)
    assert offset == len(data)
    np.testing.assert_array_equal(got[0][0], vector)
    assert results[1].error is not None and results[1].error.reason == "DEADLINE_EXCEEDED"
    assert got[1] == []
    np.testing.assert_array_equal(got[2][0], rows.astype(np.float32))
    np.testing.assert_array_equal(got[2][1], vector[1:3])
    assert got[3] == [] and results[3].error is None
