"""The OpenAI/vLLM routes' bodies as declared types, and the content parts every HTTP
door shares (OpenAI's chat parts, vLLM's multimodal forms, Cohere's inputs).

Each route's body is one msgspec Struct, decoded whole in C by service/http/json_body.py
within its bounds; its JSON Schema (service/http/openapi.py) is generated from it. Null
reads as absent, as the routes always took it, and unknown fields are skipped unread.

A content part is one Struct of the `ContentPart` union, told apart by its `type`: a new
kind of input (audio, say) is one more Struct there, with its `item`. A list of inputs
(`Inputs`) may also hold objects without a `type` (a rerank document {"text": ...},
vLLM's {"content": [parts]}), which a tagged union cannot hold beside tagged parts, so
msgspec hands such a field to `read_inputs` (the decoder's hook), which reads each entry
into its Struct and keeps a fault to be raised, with its path, when the route reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from pooling_server.engine.requests.params import Output, OutputWeights, PoolingParams
from pooling_server.engine.requests.request import ChunkRule, Item, LateChunking
from pooling_server.service.http.image_parts import audio_from_part, image_from_url, refuse

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Every integer field: the wire type (int32) bounds it, so a wider one is refused by name.
Int32 = Annotated[int, msgspec.Meta(ge=INT32_MIN, le=INT32_MAX)]
# A text-only input field: one text, or a list of them.
Texts = str | list[str]

TOKEN_IDS = (
    "token-id input is not supported: token ids of another tokenizer would be "
    "meaningless to this model; send the texts"
)
NOT_TEXTS = "must be a string or a list of strings"


# ------------------------------------------------------------------ content parts


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None  # OpenAI's; nothing to do with embeddings, skipped


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    """{"type": "text", "text": ...}"""

    text: str

    def item(self, path: str) -> Item:
        return self.text


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    """OpenAI's {"type": "image_url", "image_url": {"url": ...}} (or the url alone)."""

    image_url: ImageUrl | str

    def item(self, path: str) -> Item:
        given = self.image_url
        url = given.url if isinstance(given, ImageUrl) else given
        return image_from_url(url, f"{path}.image_url")


class InputImagePart(ImageUrlPart, tag="input_image"):
    """OpenAI's Responses form, {"type": "input_image", "image_url": ...}."""


class ImagePart(msgspec.Struct, tag_field="type", tag="image"):
    """{"type": "image", "image": <data URL or base64>}"""

    image: str

    def item(self, path: str) -> Item:
        return image_from_url(self.image, f"{path}.image")


class InputAudio(msgspec.Struct):
    data: str  # base64 of the file's bytes (or a data URL)
    format: str = ""  # "wav", "flac" or "ogg"; "" lets the bytes decide


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    """OpenAI's chat part {"type": "input_audio", "input_audio": {"data": <base64>,
    "format": "wav"}}: an audio clip, for an audio-text model (CLAP)."""

    input_audio: InputAudio

    def item(self, path: str) -> Item:
        given = self.input_audio
        return audio_from_part(given.data, given.format, f"{path}.input_audio")


ContentPart = TextPart | ImageUrlPart | InputImagePart | ImagePart | InputAudioPart
PART_TYPES = ", ".join(str(kind.__struct_config__.tag) for kind in ContentPart.__args__)


class Content(msgspec.Struct):
    """vLLM's multimodal form of one input: {"content": [parts]}."""

    content: list[ContentPart]


class TextDocument(msgspec.Struct):
    """A rerank document given as an object: its text."""

    text: str


class Message(msgspec.Struct):
    """A chat message as vLLM's embeddings route takes it; its role is not read."""

    content: str | list[ContentPart]
    role: str = "user"


Entry = str | ContentPart | list[ContentPart] | Content | TextDocument  # one input, decoded


def content_item(parts: Sequence[ContentPart], path: str) -> Item:
    """One input from content parts: its text parts joined by newlines, or its one image.
    A text and an image in one input are refused: a two-tower model (CLIP, SigLIP) embeds
    either, never both as one vector; send them as two inputs."""
    if not parts:
        raise refuse(path, "must hold at least one part")
    items = [part.item(f"{path}[{k}]") for k, part in enumerate(parts)]
    if all(isinstance(item, str) for item in items):
        return "\n".join(items)  # type: ignore[arg-type]
    if len(parts) > 1:
        raise refuse(
            path,
            "an input is one text, one image or one audio clip: a two-tower model embeds "
            "each alone; send the image (clip) and the text as separate inputs",
            "IMAGE_TEXT_MIXED",
        )
    return items[0]


def entry_item(entry: Entry, path: str) -> Item:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        return content_item(entry, path)
    if isinstance(entry, Content):
        return content_item(entry.content, f"{path}.content")
    if isinstance(entry, TextDocument):
        return entry.text
    return entry.item(path)


def messages_item(messages: Sequence[Message], path: str = "messages") -> Item:
    """vLLM's `messages` form of /v1/embeddings: the conversation is one input, so its
    parts together make one text or one image."""
    parts: list[ContentPart] = []
    for n, message in enumerate(messages):
        if isinstance(message.content, str):
            parts.append(TextPart(message.content))
        elif len(messages) == 1:
            return content_item(message.content, f"{path}[0].content")
        else:
            parts.extend(message.content)
            if any(not isinstance(p, TextPart) for p in message.content):
                raise refuse(
                    f"{path}[{n}].content",
                    "an image must be the only content of a one-message request",
                    "IMAGE_TEXT_MIXED",
                )
    return content_item(parts, path)


def has_image(items: Sequence[Item]) -> bool:
    """Whether any input is not a text: an image, or an audio clip."""
    return any(not isinstance(item, str) for item in items)


# ------------------------------------------------------------------ lists of inputs


class Inputs:
    """One input or a list of them (texts, content parts), as `read_inputs` read them; a
    fault (a path under the field, its description and reason) is raised when read."""

    __slots__ = ("entries", "fault")
    DOCUMENT = False  # Documents: an entry of the wrong type is named, not token ids

    def __init__(self, entries: list[Entry], fault: tuple[str, str, str] | None = None) -> None:
        self.entries = entries
        self.fault = fault

    def items(self, field: str) -> list[Item]:
        """The inputs as the engine's items (an image base64-decoded, not yet opened)."""
        self._check(field)
        if all(type(entry) is str for entry in self.entries):
            return list(self.entries)  # type: ignore[arg-type]
        many = isinstance(self.entries, _Listed)  # a list: each entry named by its index
        return [
            entry_item(entry, f"{field}[{n}]" if many else field)
            for n, entry in enumerate(self.entries)
        ]

    def texts(self, field: str) -> list[str]:
        """The inputs, refused unless every one is a text."""
        items = self.items(field)
        if has_image(items):
            raise refuse(field, "images and audio clips are not taken here: send texts")
        return items  # type: ignore[return-value]

    def _check(self, field: str) -> None:
        if self.fault is not None:
            where, description, reason = self.fault
            raise refuse(f"{field}{where}", description, reason)


class Documents(Inputs):
    """Rerank's documents: an entry of the wrong type is refused by its index."""

    __slots__ = ()
    DOCUMENT = True


class _Listed(list):  # type: ignore[type-arg]
    """The entries of a JSON list (one entry of a list keeps its index in paths)."""

    __slots__ = ()


_PARTS = list[ContentPart]


def read_inputs(kind: type[Inputs], value: Any) -> Inputs:
    """A field of `kind` as msgspec decoded it (a string, an object or a list): each entry
    read into its Struct, or the field's fault kept."""
    if isinstance(value, str):
        return kind([value])
    if isinstance(value, list):
        if all(type(entry) is str for entry in value):
            return kind(value)
        entries: list[Entry] = _Listed()
        for n, entry in enumerate(value):
            read = _entry(entry, kind.DOCUMENT)
            if isinstance(read, tuple):
                where, description, reason = read
                return kind([], (f"[{n}]{where}" if where is not None else "", description, reason))
            entries.append(read)
        return kind(entries)
    if isinstance(value, dict):
        read = _entry(value, kind.DOCUMENT)
        if isinstance(read, tuple):
            return kind([], (read[0] or "", read[1], read[2]))
        return kind([read])
    return kind([], ("", NOT_TEXTS, "INVALID_BODY"))


def _entry(value: Any, document: bool) -> Entry | tuple[str | None, str, str]:
    """One entry, or (its path under the entry, or None for the whole field; why; reason)."""
    if isinstance(value, str):
        return value
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, list) and value and isinstance(value[0], (int, float)):
        numeric = True
    if (document and not isinstance(value, (dict, list))) or (document and numeric):
        return "", "must be a string or an object with text", "INVALID_BODY"
    if numeric:
        return None, TOKEN_IDS, "TOKEN_INPUT_NOT_SUPPORTED"
    try:
        if isinstance(value, list):
            return msgspec.convert(value, _PARTS)
        if isinstance(value, dict):
            if "type" in value:
                return msgspec.convert(value, ContentPart)  # type: ignore[arg-type]
            if "content" in value:
                return msgspec.convert(value, Content)
            return msgspec.convert(value, TextDocument)
    except msgspec.ValidationError as error:
        message, _, at = str(error).partition(" - at `$")
        if isinstance(value, dict) and "type" not in value and "content" not in value:
            return "", "must be a string or an object with text", "INVALID_BODY"
        return _part_fault(message, at.rstrip("`"))
    return None, NOT_TEXTS, "INVALID_BODY"


def _part_fault(message: str, at: str) -> tuple[str, str, str]:
    """msgspec's refusal of a content part as (path under the entry, description)."""
    if message.startswith("Object missing required field"):
        name = message.split("`")[1]
        return f"{at}.{name}", f"a part of this type needs its {name}", "INVALID_BODY"
    if (message.startswith("Invalid value") and at.endswith(".type")) or at == ".type":
        return at, f"must be one of {PART_TYPES}, got {message[14:46]}", "INVALID_BODY"
    return at, message.replace("Expected", "must be", 1).replace("`", ""), "INVALID_BODY"


# ------------------------------------------------------------------ the bodies


class LateChunkingBody(msgspec.Struct, forbid_unknown_fields=True):
    """This server's extension of embed: character spans of the one input text, or a rule
    ("sentences"; "tokens" with window and overlap); the engine checks every value."""

    spans: list[tuple[Int32, Int32]] = []
    rule: Literal["sentences", "tokens"] | None = None
    window: Int32 = 0
    overlap: Int32 = 0


class OutputWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    """score and rerank on a bge-m3 model: the weight of each output's score."""

    dense: float = 0.0
    sparse: float = 0.0
    multi: float = 0.0


class PoolingFields(msgspec.Struct, kw_only=True):
    """vLLM's request-level pooling fields, which every OpenAI/vLLM route takes:
    use_activation (or its older names), truncate_prompt_tokens, add_special_tokens (true
    only), a bge-m3 model's output_weights, our LoRA `adapter` and `bypass_cache`."""

    model: str | None = None
    # A LoRA adapter of the model, by name (as gRPC's params.adapter); the model name may
    # name one instead, as vLLM's requests do.
    adapter: str | None = None
    # The result cache (docs/cache.md): true, neither read nor written (as gRPC's
    # params.bypass_cache; the Cache-Control header does the same on any route).
    bypass_cache: bool | None = None
    use_activation: bool | None = None
    softmax: bool | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: Int32 | None = None
    add_special_tokens: bool | None = None
    output_weights: OutputWeightsBody | None = None
    # The fields of inputs that json_body.py counts on the bytes before decoding.
    counted: ClassVar[tuple[str, ...]] = ()

    def params(self, dimensions: int | None = None) -> PoolingParams:
        """The request's PoolingParams: use_activation, or the first of its older names
        given. vLLM's add_special_tokens may only be true (its default): the texts are
        always encoded as the model was trained on them, so false is refused rather than
        ignored."""
        if self.add_special_tokens is False:
            raise refuse(
                "add_special_tokens",
                "false is not supported: every text is encoded with the model's special "
                "tokens; leave it out or send true",
                "UNSUPPORTED_FIELD",
            )
        use_activation = self.use_activation
        for older in (self.softmax, self.normalize, self.activation):
            use_activation = older if use_activation is None else use_activation
        weights = self.output_weights
        return PoolingParams(
            use_activation=use_activation,
            dimensions=dimensions,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_weights=None
            if weights is None
            else OutputWeights(weights.dense, weights.sparse, weights.multi),
        )


class FloatFields(PoolingFields):
    """How an answer carries its float arrays (service/http/float_format.py)."""

    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] | None = None
    endianness: Literal["native", "big", "little"] | None = None
    dimensions: Int32 | None = None
    late_chunking: LateChunkingBody | None = None

    def chunking(self) -> LateChunking | None:
        """`late_chunking` as the engine takes it; the engine checks every value."""
        given = self.late_chunking
        if given is None:
            return None
        rule = None if given.rule is None else ChunkRule(given.rule)
        return LateChunking(tuple(given.spans), rule, given.window, given.overlap)


class EmbeddingsBody(FloatFields):
    """OpenAI's POST /v1/embeddings: `input` (texts, or content parts with images), or
    vLLM's `messages` (one input)."""

    input: Inputs | None = None
    messages: list[Message] | None = None
    counted: ClassVar[tuple[str, ...]] = ("input",)

    def items(self) -> list[Item]:
        """`input` (texts, or content parts with images), or `messages` (one input)."""
        if self.messages is None:
            if self.input is None:
                raise refuse("input", NOT_TEXTS)
            return self.input.items("input")
        if self.input is not None:
            raise refuse("input", "send input or messages, not both")
        return [messages_item(self.messages)]


class PoolingBody(FloatFields, kw_only=True):
    """vLLM's POST /pooling: any task over texts."""

    input: Texts
    task: (
        Literal[
            "embed", "classify", "token_embed", "token_classify", "embed_multi", "embed_outputs"
        ]
        | None
    ) = None
    prompt_name: str | None = None  # embed_multi: "query" or "document"
    outputs: list[Literal["dense", "sparse", "multi"]] | None = None  # embed_outputs
    sparse_top_k: Int32 | None = None
    return_tokens: bool | None = None
    counted: ClassVar[tuple[str, ...]] = ("input",)

    def outputs_asked(self) -> dict[str, Any]:
        """embed_outputs' fields, as gRPC's OutputsInput: the outputs asked for (none
        asked: the engine's refusal), and the sparse one's shape."""
        return {
            "outputs": frozenset(Output(name) for name in self.outputs or ()),
            "sparse_top_k": self.sparse_top_k or 0,
            "sparse_tokens": bool(self.return_tokens),
        }


class ClassifyBody(PoolingFields, kw_only=True):
    """vLLM's POST /classify."""

    input: Texts
    counted: ClassVar[tuple[str, ...]] = ("input",)


class ScoreBody(PoolingFields, kw_only=True):
    """vLLM's POST /v1/score and /score: each side a text, a list, or content parts."""

    text_1: Inputs
    text_2: Inputs
    instruction: str | None = None  # an LLM reranker's
    counted: ClassVar[tuple[str, ...]] = ("text_1", "text_2")

    def sides(self) -> dict[str, tuple[Item, ...]]:
        """The two sides as text_1/text_2, or as items_1/items_2 when either holds an
        image."""
        one, two = self.text_1.items("text_1"), self.text_2.items("text_2")
        if has_image(one) or has_image(two):
            return {"items_1": tuple(one), "items_2": tuple(two)}
        return {"text_1": tuple(one), "text_2": tuple(two)}  # type: ignore[dict-item]


class RerankBody(PoolingFields, kw_only=True):
    """The Cohere/Jina shape vLLM and Infinity serve at /v1/rerank and /rerank."""

    documents: Documents
    query: str | None = None
    top_n: Int32 | None = None
    return_documents: bool | None = None
    instruction: str | None = None  # an LLM reranker's
    counted: ClassVar[tuple[str, ...]] = ("documents",)


def texts(given: str | list[str]) -> tuple[str, ...]:
    """A `Texts` field as a tuple of texts."""
    return (given,) if isinstance(given, str) else tuple(given)


def inputs_hook(kind: type, value: Any) -> Any:
    """The decoder's hook for the types msgspec does not know itself."""
    if isinstance(kind, type) and issubclass(kind, Inputs):
        return read_inputs(kind, value)
    raise NotImplementedError(kind)


def inputs_schema(kind: type) -> dict[str, Any]:
    """The JSON Schema of a type read by `inputs_hook` (for service/http/openapi.py)."""
    if isinstance(kind, type) and issubclass(kind, Inputs):
        part = {"$ref": "#/components/schemas/ContentPart"}
        entry = {
            "anyOf": [
                {"type": "string"},
                part,
                {"type": "array", "items": part},
                {"$ref": "#/components/schemas/Content"},
                {"$ref": "#/components/schemas/TextDocument"},
            ]
        }
        return {"anyOf": [*entry["anyOf"], {"type": "array", "items": entry}]}
    raise NotImplementedError(kind)
