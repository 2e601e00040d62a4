"""A served model as tokenizing and planning need it: its facts and its tokenizer, no weights.

In-process the loader's LoadedModel (which adds the runner) serves; a front-end process
builds one from what the engine process describes, without torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec
from pooling_server.engine.models.model_info import ModelInfo


@dataclass
class ServedModel:
    info: ModelInfo
    tokenizer: ModelTokenizer
    # An image model's preprocessing (engine/inputs/images.py's ImagePreprocessor), run where
    # texts are tokenized; None for text-only models.
    images: Any = field(default=None, kw_only=True)


def image_preprocessor(info: ModelInfo) -> Any:
    """The image processor of an image model's folder (None for a text-only model),
    loaded by each process that plans requests: the engine's in-process front end or a
    front-end process, which reads the same folder on the same host."""
    if info.towers is None:
        return None
    from pooling_server.engine.inputs.images import (
        load_image_processor,  # Pillow, only where images are served
    )

    processor = load_image_processor(Path(info.towers.folder))
    if processor is None:
        raise ValueError(
            f"model {info.name}: its folder {info.towers.folder} has no image processor "
            "config (preprocessor_config.json)"
        )
    return processor


@dataclass(frozen=True)
class ModelDescription:
    """What an engine process tells front ends about one of its models."""

    info: ModelInfo
    tokenizer: TokenizerSpec

    def served(self, engines_per_device: int = 1) -> ServedModel:
        """As a front end serves it, with how many engine processes compute it per device."""
        info = replace(self.info, engines_per_device=engines_per_device)
        tokenizer = ModelTokenizer(self.tokenizer, info.max_input_tokens)
        return ServedModel(info, tokenizer, images=image_preprocessor(info))
