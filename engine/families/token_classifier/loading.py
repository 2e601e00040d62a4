"""Loading a token classifier (AutoModelForTokenClassification): a class row per token."""

from __future__ import annotations

from transformers import AutoModelForTokenClassification

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import (
    config_labels,
    module_kwargs,
    serve_module,
    text_facts,
)
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import TASKS_BY_HEAD, HeadKind, PoolingType
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder if folder.head is HeadKind.TOKEN else None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    kwargs = module_kwargs(folder, context)
    module = AutoModelForTokenClassification.from_pretrained(folder.path, **kwargs)
    module = module.to(context.device).eval()
    info = text_facts(
        folder,
        context,
        module,
        family="token_classifier",
        head=HeadKind.TOKEN,
        tasks=TASKS_BY_HEAD[HeadKind.TOKEN],
        labels=config_labels(folder.config),
        pooling_type=PoolingType.ALL,
    )
    return serve_module(folder, context, module, info)
