"""engine/models/pooling.py: the numpy pooling of backends' outputs equals the torch pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pooling_server.engine.models.model_info import PoolingType
from pooling_server.engine.models.pooling import pool, pool_array


@pytest.mark.parametrize("method", [PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pool_array_equals_pool(method: PoolingType, side: str) -> None:
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((4, 9, 16)).astype(np.float32)
    mask = np.zeros((4, 9), dtype=np.int64)
    for row, n in enumerate((9, 5, 1, 3)):  # full, padded, a lone token, padded
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 9 - n :] = 1
    expected = pool(torch.from_numpy(hidden), torch.from_numpy(mask), method).numpy()
    got = pool_array(hidden, mask, method)
    assert got.shape == (4, 16) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_pool_array_refuses_token_pooling() -> None:
    hidden, mask = np.zeros((1, 2, 4), np.float32), np.ones((1, 2), np.int64)
    with pytest.raises(ValueError, match="one vector per token"):
        pool_array(hidden, mask, PoolingType.SPLADE)
