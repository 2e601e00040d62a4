"""Loading a bge-m3 folder: the encoder with its sparse and ColBERT heads as one module,
and its facts."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoModel

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.bge_m3.multi_output import (
    MultiOutputSettings,
    check_first_token,
    find_heads,
    unused_ids,
)
from pooling_server.engine.families.bge_m3.multi_output_module import MultiOutputModule, load_head
from pooling_server.engine.families.colbert.multi_vector import read_folder
from pooling_server.engine.models.loader import model_facts, module_kwargs, serve_module
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import (
    Activation,
    HeadKind,
    LongInput,
    PoolingType,
)
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.requests.params import Task

log = logging.getLogger(__name__)


def read(folder: ModelFolder) -> tuple[Path, Path] | None:
    """Its sparse_linear.pt and colbert_linear.pt; None for a folder without either."""
    heads = find_heads(folder.path)
    dense = bool(folder.st and folder.st.dense)
    if heads is not None and (
        folder.head is not HeadKind.HIDDEN or read_folder(folder.path) is not None or dense
    ):
        raise ValueError(
            f"{folder.path}: a multi-output (bge-m3) folder needs a plain encoder body without "
            "ColBERT settings or Dense modules beside its sparse and ColBERT heads"
        )
    return heads


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    """embed (dense), embed_sparse (lexical weights), embed_multi (ColBERT), embed_outputs
    (any of them from one pass) and score (dense cosine, or the weighted outputs). No
    chunking of long texts: a chunk's lexical weights and matrix would not be the text's;
    they are refused or truncated instead. Torch only, with no int8 ranges computed: its
    pooled rows carry the token heads too."""
    assert isinstance(reading, tuple)
    spec, config = context.spec, folder.config
    body = AutoModel.from_pretrained(folder.path, **module_kwargs(folder, context))
    hidden = int(config.hidden_size)
    sparse, colbert = (load_head(file, hidden) for file in reading)
    module = MultiOutputModule(body, sparse, colbert).to(context.device).eval()
    unused = unused_ids(folder.hf_tokenizer)
    check_first_token(folder.hf_tokenizer, unused, folder.path)
    long_input = spec.long_input
    if long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to bge-m3 models", spec.name)
        long_input = LongInput.REJECT
    info = model_facts(
        folder,
        context,
        module,
        family="bge_m3",
        architecture=(config.architectures or [type(module.body).__name__])[0],
        head=HeadKind.HIDDEN,
        tasks=(Task.EMBED, Task.EMBED_SPARSE, Task.EMBED_MULTI, Task.EMBED_OUTPUTS, Task.SCORE),
        hidden_size=hidden,
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.CLS,  # the dense vector is the first token's state
        default_normalize=True,
        activation=Activation.IDENTITY,
        long_input=long_input,
        settings=MultiOutputSettings(hidden, colbert.out_features, unused),
    )
    return serve_module(folder, context, module, info, calibrate=False)
