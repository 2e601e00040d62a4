"""Two towers (CLIP, SigLIP): texts and images into one space.

Its rules (rules.py), its plans over texts and frames (towers.py, which CLAP's family
shares), its settings (settings.py), its image processor for the front ends (here), the
fast form of SigLIP's slow tokenizer (tokenizer.py), and its loading and forward
(loading.py, towers_loader.py, runner.py: where models load)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.towers.rules import label_template, zero_shot_labels
from pooling_server.engine.families.towers.settings import TowerSettings
from pooling_server.engine.families.towers.tokenizer import convert_siglip
from pooling_server.engine.families.towers.towers import plan_towers

if TYPE_CHECKING:
    from pooling_server.engine.models.model_info import ModelInfo

# The transformers model types of the family's folders: CLIP, SigLIP and SigLIP 2.
MODEL_TYPES = frozenset({"clip", "siglip", "siglip2"})


def image_preprocessor(info: ModelInfo) -> Any:
    """The image processor of the model's folder, loaded by each process that plans
    requests: the engine's in-process front end or a front-end process, which reads the
    same folder on the same host."""
    from pooling_server.engine.inputs.images import (
        load_image_processor,  # Pillow, only where images are served
    )

    assert info.settings is not None
    processor = load_image_processor(Path(info.settings.folder))
    if processor is None:
        raise ValueError(
            f"model {info.name}: its folder {info.settings.folder} has no image processor "
            "config (preprocessor_config.json)"
        )
    return processor


FAMILY = Family(
    name="towers",
    plan=plan_towers,
    loading=f"{__name__}.loading",
    rules=FamilyRules(params=(zero_shot_labels,)),
    preprocessor=image_preprocessor,
    media={"image": "CLIP, SigLIP"},
    label_template=label_template,
    settings=TowerSettings,
    converters={"SiglipTokenizer": convert_siglip},  # SigLIP ships spiece.model alone
)
