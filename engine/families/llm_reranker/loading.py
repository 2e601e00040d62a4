"""Loading an LLM reranker: a decoder LM whose score template is found for the folder
(flags, then its score_template.json, then a vLLM-style chat template), reduced to the two
rows of its LM head the template reads (llm_scorer.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from transformers import AutoModelForCausalLM

from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.llm_reranker.llm_scorer import LlmScorer
from pooling_server.engine.families.llm_reranker.score_template import (
    ScoreTemplate,
    bind_template,
    find_template,
)
from pooling_server.engine.models.folder_reading import is_decoder
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


def read(folder: ModelFolder) -> ScoreTemplate | None:
    """The template the model is served with, checked against its tokenizer; None where
    none is given or found. A template given for a model that is not a decoder LM is
    refused: no LM head to read it."""
    spec, config = folder.spec, folder.config
    chat_template = (
        getattr(folder.hf_tokenizer, "chat_template", None) if is_decoder(config) else None
    )
    given = find_template(folder.path, spec.score_template, spec.score_tokens, chat_template)
    if given is None:
        return None
    name = spec.served_name
    if folder.head is not HeadKind.HIDDEN or not is_decoder(config):
        found = ", ".join(config.architectures or []) or "none"
        raise ValueError(
            f"model {name}: a score template ({given.source}) needs a decoder LM (a "
            f"*ForCausalLM architecture in config.json); this one has: {found}"
        )
    try:
        return bind_template(given, folder.tokenizer)
    except ValueError as exc:
        raise ValueError(f"model {name}: {exc}") from None


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    """Score only, one sigmoid'd logit per pair, pairs always truncated so that the
    template's prefix and suffix fit (as the model card's code)."""
    template = reading
    assert isinstance(template, ScoreTemplate)
    spec = context.spec
    # The scorer gives one row per pair, as a classifier head does (HeadKind.SEQUENCE).
    folder = replace(folder, head=HeadKind.SEQUENCE)
    lm, loading = AutoModelForCausalLM.from_pretrained(
        folder.path, output_loading_info=True, **module_kwargs(folder, context)
    )
    _check_lm_weights(folder, loading.get("missing_keys") or [])
    module = LlmScorer(lm, template.true_id, template.false_id).to(context.device).eval()
    maximum = folder.tokenizer.max_input_tokens
    if template.fixed_tokens >= maximum:
        raise ValueError(
            f"model {spec.served_name}: its score template's own parts ({template.source}) "
            f"take {template.fixed_tokens} tokens, leaving no room for a pair within the "
            f"maximum length of {maximum}"
        )
    if spec.long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to LLM rerankers", spec.name)
    info = model_facts(
        folder,
        context,
        module,
        architecture=(folder.config.architectures or [type(module).__name__])[0],
        family="llm_reranker",
        head=HeadKind.SEQUENCE,
        tasks=(Task.SCORE,),
        hidden_size=int(folder.config.get_text_config().hidden_size),
        # The tokens every pair adds (prefix, suffix, a BOS) and one of the pair's own.
        num_special_tokens=template.fixed_tokens + 1,
        pooling_type=PoolingType.LAST,
        default_normalize=False,
        activation=Activation.SIGMOID,
        long_input=LongInput.TRUNCATE,  # the pair part is cut, as the model card cuts it
        prompts={},
        default_prompt_name=None,
        settings=template,
    )
    return serve_module(folder, context, module, info)


def _check_lm_weights(folder: ModelFolder, missing: Sequence[str]) -> None:
    """An LLM reranker's weights must all come from the folder: a decoder body saved
    without its LM head (an embedding model's folder) would score with random rows."""
    if missing:
        shown = ", ".join(sorted(missing)[:4]) + (" ..." if len(missing) > 4 else "")
        raise ValueError(
            f"{folder.path}: a score template needs the decoder's LM head, and this folder "
            f"lacks {len(missing)} of the causal LM's weights ({shown}); serve a "
            "*ForCausalLM checkpoint (the reranker's own)"
        )
