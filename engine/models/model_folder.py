"""What a model's folder says before its weights load (ModelFolder), read once by the
loader and used by every loading step, the image towers' included; and the facts derived
from it alone: the hub revision and the longest input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from pooling_server.engine.inputs.tokenization import ModelTokenizer
from pooling_server.engine.models.model_info import HeadKind, PoolingType
from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec

if TYPE_CHECKING:
    import torch

FALLBACK_MAX_TOKENS = 512


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooling_type: PoolingType | None
    normalize: bool
    max_seq_length: int | None
    include_prompt: bool = True  # the Pooling module's include_prompt
    # The pooling module's folder (Pooling's, or a family's own such as SpladePooling), whose
    # config the family that pools so reads.
    pooling_folder: Path | None = None
    dense: tuple[Path, ...] = ()  # Dense module folders, applied in order after pooling


@dataclass
class ModelFolder:
    """What a model's folder says before its weights load: read once, used by every step."""

    path: Path
    hub: dict[str, Any]  # trust_remote_code and revision, for every from_pretrained
    config: PretrainedConfig  # with --hf-overrides applied
    st: SentenceTransformersConfig | None
    head: HeadKind
    hf_tokenizer: Any
    tokenizer: ModelTokenizer
    prompts: dict[str, str]
    default_prompt_name: str | None
    spec: ModelSpec  # what --model asked for, with its flags (a family's reading reads them)
    # Why modules.json is no pipeline the generic reading knows (st is then None): the
    # folder is refused as it loads, unless the family that reads it clears this, having
    # read those modules itself.
    modules_error: str = ""


def loaded_revision(source: str, path: Path, revision: str | None) -> str:
    """The hub revision a model came from: as asked, else the snapshot's commit; "" for a
    local folder or the embedded default."""
    if path == Path(source).expanduser() or (source == DEFAULT_MODEL and revision is None):
        return ""
    if revision:
        return revision
    return path.name if path.parent.name == "snapshots" else ""


def served_fields(
    spec: ModelSpec, folder: ModelFolder, module: torch.nn.Module, is_default: bool
) -> dict[str, Any]:
    """The ModelInfo fields every kind of model fills alike, from its spec, its folder and
    its loaded weights (where they sit and in what dtype), so the loaders state only what
    differs."""
    weights = next(module.parameters())
    return {
        "name": spec.served_name,
        "truncation_side": spec.truncation_side,
        "max_input_chars": spec.max_input_chars,
        "is_default": is_default,
        "dtype": str(weights.dtype).removeprefix("torch."),
        "device": str(weights.device),
        "revision": loaded_revision(spec.source, folder.path, spec.revision),
    }


def max_input_tokens(config: PretrainedConfig, tokenizer: Any, st_max: int | None) -> int:
    limits = [st_max, getattr(config, "max_position_embeddings", None)]
    if tokenizer.model_max_length and tokenizer.model_max_length < 1_000_000:
        limits.append(tokenizer.model_max_length)
    known = [int(limit) for limit in limits if limit]
    return min(known) if known else FALLBACK_MAX_TOKENS


# ------------------------------------------------------------------ slow tokenizers

# Texts a converted tokenizer must tokenize as the slow one does before it is served:
# case, punctuation, runs of spaces, tabs and newlines, accents, CJK, digits, the
# SentencePiece word mark, and nothing at all. Not special tokens written out in a text
# ("a</s>b"): the slow SiglipTokenizer, for one, marks no word start after one, and appends
# no "</s>" to a text that ends with one (a quirk its converter does not reproduce).
PROBES = (
    "a photo of a cat",
    "  A  Photo, of THE cat!!  ",
    "!!!",
    "",
    " leading and trailing ",
    "tab\there\nnewline\r\nand\u3000ideographic space",
    "Café Straße naïve ÅNGSTRÖM",
    "東京の写真 and 서울",
    "x\u2581y \u2581\u2581z",
    "numbers 3.14, 1,000 and 42%",
    'it\'s e-mail: (a) [b] {c} <d> "e" #f @g ~h',
    "ﬁne ｆｕｌｌｗｉｄｔｈ ① ™",
    "emoji 🙂 and\u00a0nbsp\u200bzero width",
)


def fast_tokenizer(tokenizer: Any, path: Path) -> Any:
    """The folder's tokenizer with a Rust (`tokenizers`) backend, which the front ends
    tokenize with: itself when it has one; else converted from the slow one (any class
    transformers converts, or one a family converts: Family.converters), as publishers
    ship SentencePiece models alone (SigLIP's `spiece.model`).

    The conversion is checked against the slow tokenizer on PROBES, and the model refused
    by name where any of them differs: a tokenizer that tokenizes otherwise than the model
    was trained with is never served."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None:
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    kind = type(tokenizer).__name__
    try:
        backend = _convert(tokenizer)
    except Exception as error:  # no converter for this class, or its model file unreadable
        raise ValueError(
            f"{path}: the tokenizer ({kind}) has no fast (Rust `tokenizers`) form and none "
            f"could be made from it ({error}); save one with tokenizer.json"
        ) from error
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=tokenizer.model_max_length,
        model_input_names=list(tokenizer.model_input_names),
        padding_side=tokenizer.padding_side,
        truncation_side=tokenizer.truncation_side,
        **{
            name: str(value)
            for name, value in tokenizer.special_tokens_map.items()
            if isinstance(value, str)
        },
    )
    for text in PROBES:
        slow, quick = tokenizer(text)["input_ids"], fast(text)["input_ids"]
        if slow != quick:
            raise ValueError(
                f"{path}: the tokenizer ({kind}) converted to a fast one tokenizes "
                f"{text!r} as {quick}, not {slow}; save a tokenizer.json that agrees"
            )
    return fast


def _convert(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` equal to the slow `tokenizer`: the converter a family has
    for its class (where transformers has none), else transformers' own."""
    from transformers.convert_slow_tokenizer import SLOW_TO_FAST_CONVERTERS

    from pooling_server.engine.families import ORDER, family

    kind = type(tokenizer).__name__
    for name in ORDER:
        converter = family(name).converters.get(kind)
        if converter is not None:
            return converter(tokenizer)
    if kind not in SLOW_TO_FAST_CONVERTERS:
        raise ValueError(f"transformers converts none of class {kind}")
    return SLOW_TO_FAST_CONVERTERS[kind](tokenizer).converted()
