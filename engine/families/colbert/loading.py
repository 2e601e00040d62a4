"""Loading a ColBERT folder (PyLate or MultiVectorEncoder): the encoder and its token
projection as one module, its modes' prefixes as the tokenizer's own tokens, and its facts."""

from __future__ import annotations

import json

from transformers import AutoModel

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.colbert.multi_vector import (
    DOCUMENT,
    QUERY,
    FolderSettings,
    read_folder,
    resolve,
)
from pooling_server.engine.families.colbert.multi_vector_module import (
    MultiVectorModule,
    load_projection,
    register_prefixes,
)
from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec
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


def read(folder: ModelFolder) -> FolderSettings | None:
    """The query/document settings of a PyLate or MultiVectorEncoder layout; None for
    other folders. Its modules (a Dense on token states, no pooling) are read here, so the
    generic reading's refusal of them is cleared."""
    found = read_folder(folder.path)
    if found is None:
        return None
    if folder.head is not HeadKind.HIDDEN:
        raise ValueError(f"{folder.path}: a multi-vector folder needs a plain encoder body")
    folder.modules_error = ""
    return found


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    """embed_multi, and score (so Rerank) by MaxSim; no single vector, since no pooling of
    its token vectors is what it was trained to give. Torch only: the exports know nothing
    of its projection and expansion mask."""
    assert isinstance(reading, FolderSettings)
    hf_tokenizer = folder.hf_tokenizer
    register_prefixes(hf_tokenizer, [reading.query_prefix, reading.document_prefix])
    folder.tokenizer = ModelTokenizer(
        TokenizerSpec.of(hf_tokenizer), folder.tokenizer.max_input_tokens
    )
    dimension = int(json.loads((reading.dense / "config.json").read_text())["out_features"])
    settings = resolve(reading, hf_tokenizer, dimension)
    # The modes as MultiVectorEncoder names them: prompt_name "query" / "document".
    folder.prompts = {
        **folder.prompts,
        QUERY: reading.query_prefix,
        DOCUMENT: reading.document_prefix,
    }
    body = AutoModel.from_pretrained(folder.path, **module_kwargs(folder, context))
    module = MultiVectorModule(body, load_projection(reading.dense), settings)
    module = module.to(context.device).eval()
    info = model_facts(
        folder,
        context,
        module,
        family="colbert",
        architecture=(folder.config.architectures or ["BertModel"])[0],
        head=HeadKind.HIDDEN,
        tasks=(Task.EMBED_MULTI, Task.SCORE),
        hidden_size=settings.dimension,
        num_special_tokens=hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.MEAN,  # unused: every request keeps its token rows
        default_normalize=True,
        activation=Activation.IDENTITY,
        long_input=LongInput.TRUNCATE,  # queries and documents are cut to their lengths
        settings=settings,
    )
    return serve_module(folder, context, module, info)
