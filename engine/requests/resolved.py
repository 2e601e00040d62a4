"""A request resolved on its model (`Resolved`), and the limits every rule reads: the facts
a request settles once (its prompt, long-input policy and truncation) before any rule,
plan or the engine reads them; shared by validation.py's tables and the families' rules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.models.model_info import LongInput, ModelInfo
from pooling_server.engine.requests.output_size import GRPC_BUDGET, ResponseBudget
from pooling_server.engine.requests.params import PROMPT_TASKS, Task
from pooling_server.engine.requests.request import PoolRequest, RerankRequest

TOKEN_TASKS = frozenset({Task.TOKEN_EMBED, Task.TOKEN_CLASSIFY})  # one output row per token


@dataclass(frozen=True)
class Limits:
    max_client_batch_size: int = 1024
    max_request_chars: int = 4 * 1024 * 1024  # all texts of one request together
    response: ResponseBudget = GRPC_BUDGET  # the largest answer (gRPC's send limit)
    # Images (engine/inputs/images.py): encoded bytes of one image (OpenAI's own cap for an image
    # input), its pixels as its header claims them (refused before decoding: 50 MP holds
    # 8K frames and 48/50 MP phone photos, 150 MB as RGB; Pillow warns past 89 MP), and
    # images in one request (each costs a decode and a tower pass).
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_images_per_request: int = 64
    # Audio clips (decoded by the audio-text family): encoded bytes of one clip, its duration,
    # sample rate and channels as its header claims them (refused before decoding; only
    # the model's clip length is ever decoded), and clips in one request.
    max_audio_bytes: int = 20 * 1024 * 1024
    max_audio_seconds: float = 600.0
    max_audio_sample_rate: int = 384_000
    max_audio_channels: int = 8
    max_audio_clips_per_request: int = 64


@dataclass(slots=True)  # not frozen: a frozen __init__ costs microseconds per request
class Resolved:
    """A request with the facts it settles on its model, found once (by `resolve`, before
    the rules run) and then read, never changed, by the rules, the planner and the engine.

    `long_input` is this request's own policy for a text past the maximum length: TRUNCATE
    where it sets truncate_prompt_tokens or the model truncates, CHUNK where the model
    chunks (and can), else REJECT. `truncate` is what the tokenizer truncates to (-1: the
    maximum length; None: it does not truncate), cutting the `side` end. `rerank` is the
    rerank request this score request computes, if any.
    """

    request: PoolRequest
    info: ModelInfo
    prompt: str | None  # prepended to every input (see prompt_text)
    long_input: LongInput
    truncate: int | None
    side: str
    rerank: RerankRequest | None = None

    @property
    def may_run_long(self) -> bool:
        """Whether a text may rightly run past the maximum length, so that the long-text
        character bound applies: truncated, or chunked into pooled outputs (chunked token
        outputs grow with the text, so those keep the tighter bound)."""
        if self.long_input is LongInput.CHUNK:
            return self.request.task not in TOKEN_TASKS
        return self.long_input is LongInput.TRUNCATE

    @property
    def token_cap(self) -> int | None:
        """The most tokens of one text's output rows: its truncation, or the maximum length
        (past which the length rule refuses it); None where long texts are chunked."""
        if self.truncate is not None and self.truncate > 0:
            return self.truncate
        if self.long_input is LongInput.CHUNK:
            return None
        return self.info.max_input_tokens


def resolve(request: PoolRequest, info: ModelInfo, rerank: RerankRequest | None = None) -> Resolved:
    """The one place a request's prompt, long-input policy and truncation are decided."""
    truncate = request.params.truncate_prompt_tokens
    if request.late_chunking is not None:  # macro-windows read the whole text
        policy, truncate = LongInput.CHUNK, None
    elif truncate is not None:
        policy = LongInput.TRUNCATE
    elif info.long_input is LongInput.TRUNCATE:
        policy, truncate = LongInput.TRUNCATE, -1
    elif info.chunks_long_input:
        policy = LongInput.CHUNK
    else:
        policy = LongInput.REJECT
    side = request.truncation_side or info.truncation_side
    return Resolved(request, info, prompt_text(request, info), policy, truncate, side, rerank)


Check = Callable[[Resolved, Limits], Iterator[FieldViolation]]


def list_path(request: PoolRequest) -> str:
    """The path of a request's (second) input list, as the request gave it."""
    if request.task is Task.SCORE:
        return "score.items_2" if request.items_2 else "score.text_2"
    return f"{request.task}.items" if request.items else f"{request.task}.texts"


def prompt_text(request: PoolRequest, info: ModelInfo) -> str | None:
    """The text prepended to every input: the request's prompt, else its named prompt, else
    the model's default. None where no prompt applies: a task without prompts (see
    PROMPT_TASKS), or an unknown name (which _prompt_name reports)."""
    if request.task not in PROMPT_TASKS:
        return None
    if request.prompt is not None:
        return request.prompt
    name = request.prompt_name if request.prompt_name is not None else info.default_prompt_name
    return None if name is None else info.prompts.get(name)
