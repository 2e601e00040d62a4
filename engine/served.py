"""A served model as tokenizing and planning need it: its facts and its tokenizer, no weights.

In-process the loader's LoadedModel (which adds the runner) serves; a front-end process
builds one from what the engine process describes, without torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model_info import ModelInfo
from engine.tokenization import ModelTokenizer, TokenizerSpec


@dataclass
class ServedModel:
    info: ModelInfo
    tokenizer: ModelTokenizer


@dataclass(frozen=True)
class ModelDescription:
    """What an engine process tells front ends about one of its models."""

    info: ModelInfo
    tokenizer: TokenizerSpec

    def served(self, engines_per_device: int = 1) -> ServedModel:
        """As a front end serves it, with how many engine processes compute it per device."""
        info = replace(self.info, engines_per_device=engines_per_device)
        return ServedModel(info, ModelTokenizer(self.tokenizer, info.max_input_tokens))
