"""Loading a SPLADE model (AutoModelForMaskedLM with SPLADE pooling): a SparseEncoder
folder's SpladePooling settings, or --pooling-type splade over a masked-LM folder."""

from __future__ import annotations

from transformers import AutoModelForMaskedLM

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.splade.pooling import SpladePooling
from pooling_server.engine.families.splade.settings import SpladeSettings, read_splade_pooling
from pooling_server.engine.models.loader import module_kwargs, serve_module, text_facts
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import HeadKind, PoolingType
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.requests.params import Task


def read(folder: ModelFolder) -> object | None:
    """The folder's SpladePooling settings; SPLADE v2's max over relu under --pooling-type
    splade without a SparseEncoder config."""
    st = folder.st
    pooling = folder.spec.pooling_type or (st.pooling_type if st else None)
    if folder.head is not HeadKind.TOKEN or pooling is not PoolingType.SPLADE:
        return None
    if st is not None and st.pooling_type is PoolingType.SPLADE and st.pooling_folder:
        return read_splade_pooling(st.pooling_folder)
    return SpladeSettings()


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    assert isinstance(reading, SpladeSettings)
    module = AutoModelForMaskedLM.from_pretrained(folder.path, **module_kwargs(folder, context))
    module = module.to(context.device).eval()
    info = text_facts(
        folder,
        context,
        module,
        family="splade",
        head=HeadKind.TOKEN,  # the masked LM's logits per token, pooled by SpladePooling
        tasks=(Task.EMBED_SPARSE,),
        default_normalize=True,  # use_activation (SPLADE's log saturation) on by default
        settings=reading,
    )
    return serve_module(folder, context, module, info, pool_logits=SpladePooling(reading))
