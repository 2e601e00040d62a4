"""Loading a classifier or cross-encoder (AutoModelForSequenceClassification): one label
scores pairs as well (a cross-encoder), several classify only."""

from __future__ import annotations

from transformers import AutoModelForSequenceClassification

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import (
    config_labels,
    module_kwargs,
    serve_module,
    text_facts,
)
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import HeadKind
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.requests.params import Task


def read(folder: ModelFolder) -> object | None:
    return folder if folder.head is HeadKind.SEQUENCE else None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    kwargs = module_kwargs(folder, context)
    module = AutoModelForSequenceClassification.from_pretrained(folder.path, **kwargs)
    module = module.to(context.device).eval()
    pairs = folder.config.num_labels == 1
    info = text_facts(
        folder,
        context,
        module,
        family="cross_encoder",
        head=HeadKind.SEQUENCE,
        tasks=(Task.CLASSIFY, Task.SCORE) if pairs else (Task.CLASSIFY,),
        labels=config_labels(folder.config),
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=pairs),
    )
    return serve_module(folder, context, module, info)
