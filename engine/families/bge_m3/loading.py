"""Loading a bge-m3 folder: the encoder with its sparse and ColBERT heads."""

from __future__ import annotations

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import load_transformer
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder.multi_output_heads


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    return load_transformer(folder, context, "bge_m3")
