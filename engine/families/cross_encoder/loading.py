"""Loading a sequence-classification head (AutoModelForSequenceClassification)."""

from __future__ import annotations

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import load_transformer
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import HeadKind
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder if folder.head is HeadKind.SEQUENCE else None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    return load_transformer(folder, context, "cross_encoder")
