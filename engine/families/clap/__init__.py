"""CLAP: texts and audio clips into one space (transformers' ClapModel: a RoBERTa text
tower, an HTSAT audio tower). A second two-tower family: its plans are the towers' (embed,
score and rerank by cosine, zero-shot classify over candidate labels), over audio clips
where CLIP has images; what is its own is here: its audio decoding within bounds
(audio.py, torch-free, run by every front end), its rule on clips per request, and its
loading (loading.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.towers.rules import label_template, zero_shot_labels
from pooling_server.engine.families.towers.settings import TowerSettings
from pooling_server.engine.families.towers.towers import plan_towers

if TYPE_CHECKING:
    from pooling_server.engine.errors import FieldViolation
    from pooling_server.engine.models.model_info import ModelInfo
    from pooling_server.engine.requests.resolved import Limits, Resolved

LABEL_TEMPLATE = "This is a sound of {label}."  # the zero-shot-audio-classification pipeline's


def _clips_per_request(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """No more audio clips in one request than --max-audio-clips-per-request: each costs a
    decode, a resampling and a pass of the audio tower."""
    from pooling_server.engine.errors import FieldViolation
    from pooling_server.engine.requests.item_rules import item_lists

    request = r.request
    if not (request.items or request.items_1 or request.items_2):
        return
    given = list(item_lists(request))
    clips = sum(getattr(item, "modality", "") == "audio" for _, items in given for item in items)
    if clips > limits.max_audio_clips_per_request:
        yield FieldViolation(
            given[-1][0],
            f"{clips} audio clips exceed the limit of {limits.max_audio_clips_per_request} per "
            "request (--max-audio-clips-per-request); split the request",
            "TOO_MANY_AUDIO_CLIPS",
        )


def _preprocessor(info: ModelInfo) -> Any:
    """The clips' decoding for this model, read from its folder's feature extractor."""
    from pooling_server.engine.families.clap.audio import AudioFrames, read_settings

    assert info.settings is not None
    settings = read_settings(Path(info.settings.folder))
    if settings is None:
        raise ValueError(
            f"model {info.name}: its folder {info.settings.folder} has no feature extractor "
            "config (preprocessor_config.json or processor_config.json)"
        )
    return AudioFrames(settings, info.settings.patches)


FAMILY = Family(
    name="clap",
    plan=plan_towers,
    loading=f"{__name__}.loading",
    rules=FamilyRules(shape=(_clips_per_request,), params=(zero_shot_labels,)),
    backends=("torch",),
    title="CLAP",
    preprocessor=_preprocessor,
    media={"audio": "CLAP"},
    label_template=label_template,
    settings=TowerSettings,
)
