"""Loading a two-tower image-text model (CLIP, SigLIP, SigLIP 2): see towers_loader.py."""

from __future__ import annotations

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.towers import MODEL_TYPES
from pooling_server.engine.families.towers.towers_loader import load_towers
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    """A CLIP, SigLIP or SigLIP 2 folder, by its config's model type."""
    return folder if getattr(folder.config, "model_type", "") in MODEL_TYPES else None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    return load_towers(
        context.spec,
        folder,
        context.device,
        context.dtype,
        context.is_default,
        context.runtime,
        context.threads,
    )
