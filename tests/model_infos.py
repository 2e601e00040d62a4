"""What a served model says of itself (ModelInfo), built without weights, for the tests of
rules, sizes and decoding that need a model's facts and nothing else."""

from __future__ import annotations

from pooling_server.engine.models.model_info import Activation, HeadKind, ModelInfo, PoolingType
from pooling_server.engine.requests.params import Task


def embedder_info(**fields: object) -> ModelInfo:
    """A small BERT embedder (hidden 32, 128 tokens, mean pooling); `fields` override."""
    base: dict[str, object] = {
        "name": "m",
        "family": "encoder",
        "architecture": "BertModel",
        "head": HeadKind.HIDDEN,
        "tasks": (Task.EMBED, Task.TOKEN_EMBED, Task.SCORE),
        "hidden_size": 32,
        "max_input_tokens": 128,
        "num_special_tokens": 2,
        "pooling_type": PoolingType.MEAN,
        "default_normalize": True,
        "activation": Activation.IDENTITY,
    }
    return ModelInfo(**{**base, **fields})  # type: ignore[arg-type]
