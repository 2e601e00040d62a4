"""A pooling request as the engine sees it, after the transport has decoded it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.params import Output, OutputEncoding, PoolingParams, Task


class ChunkRule(StrEnum):
    """How late chunking cuts a text when the request gives no spans."""

    SENTENCES = "sentences"
    TOKENS = "tokens"  # fixed windows of `window` tokens, `overlap` shared by neighbours


@dataclass(frozen=True)
class LateChunking:
    """Embed chunks of each text from one pass over the whole text
    (engine/requests/late_chunking.py).

    Either `spans`, character spans [start, end) of the request's one text (any order,
    overlap allowed), or a `rule` applied to every text."""

    spans: tuple[tuple[int, int], ...] = ()
    rule: ChunkRule | None = None
    window: int = 0  # ChunkRule.TOKENS: tokens per chunk
    overlap: int = 0  # ChunkRule.TOKENS: tokens shared by consecutive chunks


@dataclass(frozen=True)
class Image:
    """One encoded image as the door received it (PNG, JPEG, WebP, GIF...).

    Kept encoded until the front end's intake thread decodes it (engine/inputs/image_decoding.py),
    so a door never spends its event loop on pixels."""

    data: bytes
    mime_type: str = ""  # the client's claim, if any; the bytes decide the format

    modality = "image"  # engine/inputs/modality.py's value: what a model must accept


@dataclass(frozen=True)
class Audio:
    """One encoded audio clip as the door received it (WAV, FLAC, OGG), kept encoded until
    the front end's intake thread decodes it (its model's family's decoding)."""

    data: bytes
    mime_type: str = ""  # the client's claim, if any; the bytes decide the format

    modality = "audio"


Media = Image | Audio  # an input that is not a text: decoded into a Frame on intake
Item = str | Media  # one input of a two-tower model: a text, an image or an audio clip


@dataclass(frozen=True)
class PoolRequest:
    """One task over a batch of texts (or text pairs for score).

    `task` comes from the input case and is None when no input was given;
    `declared_task` is the optional task named in the params, which must agree.
    """

    task: Task | None
    params: PoolingParams = field(default_factory=PoolingParams)
    request_id: str = ""
    model: str = ""
    declared_task: Task | None = None
    texts: tuple[str, ...] = ()
    text_1: tuple[str, ...] = ()
    text_2: tuple[str, ...] = ()
    prompt_name: str | None = None  # a prompt of the model's, prepended to every text
    prompt: str | None = None  # or a raw one (not both)
    encoding: OutputEncoding = OutputEncoding.FLOAT  # embed and token_embed outputs
    sparse_top_k: int = 0  # embed_sparse: keep the k largest weights (0: all non-zero)
    sparse_tokens: bool = False  # embed_sparse: also return each index's token
    # Which end truncation cuts ("left" or "right"); None: the model's --truncation-side.
    truncation_side: str | None = None
    # The door's bound on the answer (the HTTP API's); None: the engine's, Limits.response.
    response_budget: ResponseBudget | None = None
    # Refuse, never cut, a text of more tokens than this (Cohere's truncate NONE with
    # max_tokens), at least the model's special tokens; None: the model's maximum alone.
    max_tokens: int | None = None
    # embed only: one vector per chunk of each text instead of one per text.
    late_chunking: LateChunking | None = None
    # embed_outputs: which of a multi-output (bge-m3) model's outputs each text gets
    # (sparse_top_k and sparse_tokens shape its sparse one).
    outputs: frozenset[Output] = frozenset()
    # Image models: inputs that may be texts or images, in place of texts (embed,
    # classify) or of text_1/text_2 (score). A request uses texts or items, never both.
    items: tuple[Item, ...] = ()
    items_1: tuple[Item, ...] = ()
    items_2: tuple[Item, ...] = ()
    # classify on an image model: zero-shot over these labels, each put in label_template
    # ("{label}" replaced; None: the server's default, "a photo of a {label}.").
    candidate_labels: tuple[str, ...] = ()
    label_template: str | None = None
    # The LoRA adapter of `model` its texts run with (PoolingParams.adapter, or a model
    # name naming an adapter); None: the base weights. The engine resolves it before the
    # request is queued (Engine.pool): from then on `model` is the base model's name and
    # this the adapter's, so (model, adapter) names the weights that compute it.
    adapter: str | None = None
    # The result cache (engine/caching): skip it, neither read nor written (the
    # PoolingParams field, the HTTP Cache-Control header); and the scope its entries are
    # kept under (an API key's digest with --cache-scope key; "": shared).
    bypass_cache: bool = False
    cache_scope: str = ""

    @property
    def num_items(self) -> int:
        """Texts (or items) for the text tasks, pairs for score (1:N counts N)."""
        if self.task is Task.SCORE:
            return max(len(self.text_1 or self.items_1), len(self.text_2 or self.items_2))
        return len(self.texts or self.items)


@dataclass(frozen=True)
class RerankRequest:
    """Documents ranked against one query: computed as the 1:N score request `score`."""

    query: str
    documents: tuple[str, ...]
    params: PoolingParams = field(default_factory=PoolingParams)
    request_id: str = ""
    model: str = ""
    declared_task: Task | None = None
    top_n: int = 0  # the best top_n results; 0 (or more than there are documents): all
    truncation_side: str | None = None  # as PoolRequest's
    # An LLM reranker's instruction (its score template's {instruction}), carried as the
    # score request's prompt; None: the template's default.
    instruction: str | None = None
    # Image models: the documents as items (texts or images) in place of `documents`.
    items: tuple[Item, ...] = ()
    adapter: str | None = None  # as PoolRequest's
    bypass_cache: bool = False  # as PoolRequest's
    cache_scope: str = ""  # as PoolRequest's

    @cached_property
    def score(self) -> PoolRequest:
        """The score request whose scores rank the documents."""
        return PoolRequest(
            task=Task.SCORE,
            params=self.params,
            request_id=self.request_id,
            model=self.model,
            declared_task=self.declared_task,
            text_1=() if self.items else (self.query,),
            text_2=self.documents,
            items_1=(self.query,) if self.items else (),
            items_2=self.items,
            truncation_side=self.truncation_side,
            prompt=self.instruction,
            adapter=self.adapter,
            bypass_cache=self.bypass_cache,
            cache_scope=self.cache_scope,
        )


def has_media(request: PoolRequest) -> bool:
    """Whether any input of the request is not a text: an image or an audio clip (a
    Rerank's documents included)."""
    return any(
        type(item) is not str
        for items in (request.items, request.items_1, request.items_2)
        for item in items
    )
