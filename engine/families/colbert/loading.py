"""Loading a ColBERT folder (PyLate or MultiVectorEncoder): the encoder and its projection."""

from __future__ import annotations

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import load_transformer
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder.multi_vector


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    return load_transformer(folder, context, "colbert")
