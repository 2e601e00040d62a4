"""Loading a SPLADE model (AutoModelForMaskedLM with SPLADE pooling): a SparseEncoder
folder's SpladePooling settings, or --pooling-type splade over a masked-LM folder."""

from __future__ import annotations

from transformers import AutoModelForMaskedLM

from pooling_server.engine.families import LoadContext
from pooling_server.engine.models.loader import module_kwargs, serve_module, text_facts
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import (
    TASKS_BY_HEAD,
    HeadKind,
    SpladeActivation,
    SpladeStrategy,
)
from pooling_server.engine.models.model_runner import LoadedModel


def read(folder: ModelFolder) -> object | None:
    return folder if folder.head is HeadKind.SPARSE else None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    module = AutoModelForMaskedLM.from_pretrained(folder.path, **module_kwargs(folder, context))
    module = module.to(context.device).eval()
    # --pooling-type splade without a SparseEncoder config: SPLADE v2's max over relu.
    st = folder.st
    strategy, activation = (st.splade if st else None) or (
        SpladeStrategy.MAX,
        SpladeActivation.RELU,
    )
    info = text_facts(
        folder,
        context,
        module,
        family="splade",
        head=HeadKind.SPARSE,
        tasks=TASKS_BY_HEAD[HeadKind.SPARSE],
        default_normalize=True,  # use_activation (SPLADE's log saturation) on by default
        splade_strategy=strategy,
        splade_activation=activation,
    )
    return serve_module(folder, context, module, info)
