"""Loading a pooled text encoder: any folder no other family claims (AutoModel)."""

from __future__ import annotations

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import load_transformer
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder  # last in ORDER: every folder left is an encoder's


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    return load_transformer(folder, context, "encoder")
