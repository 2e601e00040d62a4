"""Loading a pooled text encoder (AutoModel): any folder of token states no other family
claims, with sentence-transformers' Dense modules projecting its pooled vectors."""

from __future__ import annotations

from transformers import AutoModel

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.encoder.settings import EncoderSettings
from pooling_server.engine.models.folder_reading import is_causal_lm
from pooling_server.engine.models.loader import (
    dense_projection,
    module_kwargs,
    serve_module,
    text_facts,
)
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import TASKS_BY_HEAD, HeadKind
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.requests.params import Task


def read(folder: ModelFolder) -> object | None:
    return folder if folder.head is HeadKind.HIDDEN else None  # last in ORDER


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    projection = dense_projection(folder, context.device)
    module = AutoModel.from_pretrained(folder.path, **module_kwargs(folder, context))
    module = module.to(context.device).eval()
    tasks = TASKS_BY_HEAD[HeadKind.HIDDEN]
    # A decoder LM checkpoint (not an embedding model's folder: sentence-transformers
    # modules, or a bare decoder body) has no score without a template.
    refusal = folder.st is None and is_causal_lm(folder.config)
    if refusal:  # listed without score, which it refuses saying why (settings.score_refusal)
        tasks = tuple(task for task in tasks if task is not Task.SCORE)
    info = text_facts(
        folder,
        context,
        module,
        projection,
        family="encoder",
        head=HeadKind.HIDDEN,
        tasks=tasks,
        settings=EncoderSettings(decoder_lm_without_template=refusal),
    )
    return serve_module(folder, context, module, info, projection)
