"""PoolingParams: how to pool, checked on the client before anything is sent.

Mirrors vLLM's ``PoolingParams`` so code written against ``vllm.LLM`` ports over. The server
re-validates everything; checking here only turns an obvious mistake into a ``ValueError``
without a round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

from pooling_client.v1 import pooling_pb2

#: The tasks a request can run, by the names vLLM uses.
TASKS: tuple[str, ...] = (
    "embed",
    "classify",
    "score",
    "token_embed",
    "token_classify",
    "embed_sparse",
    "embed_multi",
    "embed_outputs",
)

_EMBED_PARAMS = frozenset({"use_activation", "dimensions", "truncate_prompt_tokens"})
_CLASSIFY_PARAMS = frozenset({"use_activation", "truncate_prompt_tokens"})

#: Which PoolingParams fields each task accepts (as in vLLM's ``valid_parameters``).
TASK_PARAMS: dict[str, frozenset[str]] = {
    "embed": _EMBED_PARAMS,
    "token_embed": _EMBED_PARAMS,
    "classify": _CLASSIFY_PARAMS,
    "score": _CLASSIFY_PARAMS | {"output_weights"},
    "token_classify": _CLASSIFY_PARAMS,
    "embed_sparse": _CLASSIFY_PARAMS,
    "embed_multi": frozenset({"truncate_prompt_tokens"}),
    # bge-m3: use_activation normalises the dense vector (the matrix always is).
    "embed_outputs": _CLASSIFY_PARAMS,
}

#: Task name -> wire enum value.
TASK_ENUM: dict[str, pooling_pb2.PoolingTask] = {
    "embed": pooling_pb2.POOLING_TASK_EMBED,
    "classify": pooling_pb2.POOLING_TASK_CLASSIFY,
    "score": pooling_pb2.POOLING_TASK_SCORE,
    "token_embed": pooling_pb2.POOLING_TASK_TOKEN_EMBED,
    "token_classify": pooling_pb2.POOLING_TASK_TOKEN_CLASSIFY,
    "embed_sparse": pooling_pb2.POOLING_TASK_EMBED_SPARSE,
    "embed_multi": pooling_pb2.POOLING_TASK_EMBED_MULTI,
    "embed_outputs": pooling_pb2.POOLING_TASK_EMBED_OUTPUTS,
}

_OPTIONAL_FIELDS = ("use_activation", "dimensions", "truncate_prompt_tokens")


CHUNK_RULES: dict[str, pooling_pb2.ChunkRule] = {
    "sentences": pooling_pb2.CHUNK_RULE_SENTENCES,
    "tokens": pooling_pb2.CHUNK_RULE_TOKENS,
}


@dataclass(frozen=True)
class LateChunking:
    """Late chunking for ``embed``: one vector per chunk of each text, each the mean of the
    chunk's token states from one pass over the whole text. Give ``spans`` (character spans
    [start, end) of the request's one text) or a ``rule``: "sentences", or "tokens" with
    ``window`` tokens per chunk and ``overlap`` tokens shared by neighbours."""

    spans: tuple[tuple[int, int], ...] = ()
    rule: str | None = None
    window: int = 0
    overlap: int = 0

    def to_proto(self) -> pooling_pb2.LateChunking:
        if self.rule is not None and self.rule not in CHUNK_RULES:
            raise ValueError(f"rule must be one of {list(CHUNK_RULES)}, got {self.rule!r}")
        message = pooling_pb2.LateChunking(window_tokens=self.window, overlap_tokens=self.overlap)
        if self.rule is not None:
            message.rule = CHUNK_RULES[self.rule]
        for start, end in self.spans:
            message.spans.add(start=start, end=end)
        return message


def check_task(task: str) -> None:
    """Raise ValueError unless ``task`` is one of :data:`TASKS`."""
    if task not in TASK_PARAMS:
        raise ValueError(f"Unknown pooling task {task!r}; expected one of {list(TASKS)}")


@dataclass(frozen=True)
class OutputWeights:
    """score and rerank on a multi-output (bge-m3) model: the weight of each output's score
    in the combined one, sum(weight * score) / sum(weight), as bge-m3's compute_score."""

    dense: float = 0.0
    sparse: float = 0.0
    multi: float = 0.0

    def verify(self) -> None:
        values = (self.dense, self.sparse, self.multi)
        if any(not 0 <= v < float("inf") for v in values) or not any(values):
            raise ValueError(
                f"output_weights must be finite and >= 0, at least one > 0; got {values}"
            )


@dataclass
class PoolingParams:
    """How to pool; unset (None) fields take the model's defaults on the server.

    Attributes:
        use_activation: embed/token_embed: L2-normalise; classify/score/token_classify:
            apply the model's activation (softmax or sigmoid); embed_sparse: SPLADE's
            log(1 + w) saturation (False: max over tokens of relu(logits)).
        dimensions: embed/token_embed on matryoshka models: keep this many leading dimensions.
        task: optional; when set it must equal the task being run.
        truncate_prompt_tokens: keep this many tokens per text (-1: the model's maximum).
        output_weights: score/rerank on a multi-output (bge-m3) model: combine its dense,
            sparse and multi scores with these weights (None: the dense score alone).
        adapter: a LoRA adapter of the model, by name, for any task (None: the one the
            model name names, if it names one, else the base weights).
        bypass_cache: True: the server's result cache neither answers nor keeps this call
            (any task; a server without one ignores it).
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    task: str | None = None
    truncate_prompt_tokens: int | None = None
    output_weights: OutputWeights | None = None
    adapter: str | None = None
    bypass_cache: bool = False

    def verify(self, task: str) -> None:
        """Raise ValueError if these params cannot be used for ``task`` (like vLLM's verify).

        Unlike vLLM this does not fill in ``self.task``: a params object can be reused for
        different tasks as long as it leaves ``task`` unset.
        """
        check_task(task)
        if self.task is not None:
            check_task(self.task)
            if self.task != task:
                raise ValueError(f"You cannot overwrite task={self.task!r} with task={task!r}")
        allowed = TASK_PARAMS[task]
        given = (*_OPTIONAL_FIELDS, "output_weights")
        invalid = [name for name in given if getattr(self, name) is not None]
        invalid = [name for name in invalid if name not in allowed]
        if invalid:
            raise ValueError(
                f"Task {task} only supports {sorted(allowed)} parameters, "
                f"does not support {invalid} parameters"
            )
        if self.output_weights is not None:
            self.output_weights.verify()
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (tpt < -1 or tpt == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {tpt}")

    def to_proto(self, task: str) -> pooling_pb2.PoolingParams:
        """Build the wire message for ``task``; only fields that are set are sent.

        The wire task is ``self.task`` when set, else ``task``. This does not call
        :meth:`verify`, so params the server should reject can still be sent as given
        (useful for testing the server); the clients verify before calling this.
        """
        check_task(task)
        wire_task = task if self.task is None else self.task
        check_task(wire_task)
        message = pooling_pb2.PoolingParams(task=TASK_ENUM[wire_task])
        for name in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        if self.adapter:
            message.adapter = self.adapter
        if self.bypass_cache:
            message.bypass_cache = True
        weights = self.output_weights
        if weights is not None:
            message.output_weights.CopyFrom(
                pooling_pb2.OutputWeights(
                    dense=weights.dense, sparse=weights.sparse, multi=weights.multi
                )
            )
        return message
