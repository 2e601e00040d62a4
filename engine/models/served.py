"""A served model as tokenizing and planning need it: its facts and its tokenizer, no weights.

In-process the loader's LoadedModel (which adds the runner) serves; a front-end process
builds one from what the engine process describes, without torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec
from pooling_server.engine.models.model_info import ModelInfo


@dataclass
class ServedModel:
    info: ModelInfo
    tokenizer: ModelTokenizer
    # A model's preprocessing of its inputs that are not texts, run where texts are
    # tokenized (its family's: see `preprocessor`); None for text-only models.
    images: Any = field(default=None, kw_only=True)


def preprocessor(info: ModelInfo) -> Any:
    """The preprocessing of a model's inputs that are not texts, its family's own
    (Family.preprocessor: the towers' image processor, CLAP's audio), built by each process
    that plans requests: the engine's in-process front end or a front-end process, which
    reads the same folder on the same host. None for a family of texts only."""
    from pooling_server.engine.families import family_of

    own = family_of(info).preprocessor
    return own(info) if own is not None else None


@dataclass(frozen=True)
class ModelDescription:
    """What an engine process tells front ends about one of its models."""

    info: ModelInfo
    tokenizer: TokenizerSpec

    def served(self, engines_per_device: int = 1) -> ServedModel:
        """As a front end serves it, with how many engine processes compute it per device."""
        info = replace(self.info, engines_per_device=engines_per_device)
        tokenizer = ModelTokenizer(self.tokenizer, info.max_input_tokens)
        return ServedModel(info, tokenizer, images=preprocessor(info))
