"""Loading a model folder (or the embedded default, or a hub id) into a ready-to-run model:
the generic path. The folder is read once (folder_reading.py), each family in ORDER is
asked whether it is its own, and the first that claims it loads it, with the helpers here
that every family's loading shares (its facts, the forward chosen, int8 ranges, CUDA
graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
)

from pooling_server.engine.backends import BackendKind, RuntimeSettings
from pooling_server.engine.families import ORDER, LoadContext, loading
from pooling_server.engine.models.adapters import AdapterSet
from pooling_server.engine.models.calibration import FOLDER
from pooling_server.engine.models.cuda_graphs import (
    Buckets,
    GraphedForward,
    GraphSettings,
    attention_of,
    why_eager,
)
from pooling_server.engine.models.dense import DenseLayer, load_dense
from pooling_server.engine.models.folder_reading import (
    classifier_activation,
    is_decoder,
    read_folder,
)
from pooling_server.engine.models.forward import choose_forward, with_computed_ranges
from pooling_server.engine.models.model_folder import (
    ModelFolder,
    served_fields,
)
from pooling_server.engine.models.model_info import (
    HeadKind,
    LongInput,
    ModelInfo,
    PoolingType,
)
from pooling_server.engine.models.model_runner import LoadedModel, ModelRunner
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.encodings import read_calibration_ranges
from pooling_server.engine.requests.params import Task

log = logging.getLogger(__name__)

MIB = 1 << 20


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
    if spec.adapters:  # PEFT's layers run in the torch module, eagerly
        spec, cuda_graphs = torch_for_adapters(spec), None
    folder = read_folder(spec)
    context = LoadContext(
        spec, device, dtype, attn_implementation, is_default, runtime, threads, cuda_graphs
    )
    for name in ORDER:
        family_loading = loading(name)
        reading = family_loading.read(folder)
        if reading is not None:
            if folder.modules_error:  # modules.json no one reads: refused, as it was read
                raise ValueError(folder.modules_error)
            loaded = family_loading.load(folder, reading, context)
            # Where its files are: the result cache hashes them into its key (engine/caching).
            loaded.runner.folder = folder.path
            for adapter, path in spec.adapters:
                load_adapter(loaded.runner, adapter, path)
            if spec.adapters:
                names = tuple(adapter for adapter, _ in spec.adapters)
                loaded.info = loaded.runner.info = replace(loaded.info, adapters=names)
            return loaded
    raise ValueError(f"{folder.path}: no model family serves this folder")


def torch_for_adapters(spec: ModelSpec) -> ModelSpec:
    """A model given adapters runs on torch: PEFT's LoRA layers live in the torch module,
    which an export (OpenVINO, ONNX Runtime) replaces. --backend auto becomes torch; any
    other backend, or --quantize, is refused by name."""
    options = spec.backend
    if options.kind not in (BackendKind.AUTO, BackendKind.TORCH) or options.file:
        raise ValueError(
            f"model {spec.served_name}: LoRA adapters (--adapter) run on --backend torch, "
            f"not {options.kind}{' with --backend-file' if options.file else ''}"
        )
    if options.quantize:
        raise ValueError(
            f"model {spec.served_name}: LoRA adapters (--adapter) run unquantized on torch; "
            "drop --quantize"
        )
    return replace(spec, backend=replace(options, kind=BackendKind.TORCH))


def load_adapter(runner: ModelRunner, name: str, path: str) -> int:
    """A PEFT LoRA adapter read onto a loaded model's torch module, beside its base weights
    (engine/models/adapters.py): the bytes its matrices take. ValueError naming why a model
    cannot take one (an export runs it, or CUDA graphs replay it)."""
    module, info = runner.module, runner.info
    if not isinstance(module, PreTrainedModel) or info.backend != BackendKind.TORCH:
        raise ValueError(
            f"model {info.name} runs on {info.backend} ({info.family}); a LoRA adapter "
            "needs a transformers module on torch: start the model with --backend torch, or "
            "with an --adapter"
        )
    if runner.graphs is not None:
        raise ValueError(
            f"model {info.name} replays CUDA graphs, which would not switch adapters: start "
            "it with --cuda-graphs off, or with an --adapter"
        )
    if runner.adapters is None:
        runner.adapters = AdapterSet(module, info.name)
    return runner.adapters.load(name, path)


def module_kwargs(folder: ModelFolder, context: LoadContext) -> dict[str, Any]:
    """What every from_pretrained of the folder's weights takes: its config (with
    --hf-overrides), dtype, attention and the hub settings."""
    kwargs: dict[str, Any] = {"config": folder.config, "dtype": context.dtype, **folder.hub}
    if context.attn_implementation:
        kwargs["attn_implementation"] = context.attn_implementation
    return kwargs


def model_facts(
    folder: ModelFolder, context: LoadContext, module: torch.nn.Module, **fields: Any
) -> ModelInfo:
    """A model's facts as a family states them (`fields`), over what every text model
    fills alike: its spec's, its folder's and where its weights sit."""
    spec, config = context.spec, folder.config
    base: dict[str, Any] = {
        **served_fields(spec, folder, module, context.is_default),
        "architecture": (config.architectures or [type(module).__name__])[0],
        "max_input_tokens": folder.tokenizer.max_input_tokens,
        "long_input": spec.long_input,
        "prompts": folder.prompts,
        "default_prompt_name": folder.default_prompt_name,
    }
    return ModelInfo(**{**base, **fields})


def text_facts(
    folder: ModelFolder,
    context: LoadContext,
    module: torch.nn.Module,
    projection: Sequence[DenseLayer] = (),
    **fields: Any,
) -> ModelInfo:
    """A text model's facts as its config and sentence-transformers modules give them
    (pooling, normalisation, matryoshka, the prompt's pooling, shipped int8 ranges), under
    what its family states (`fields`: family, head, tasks, ...). `projection`: its Dense
    modules, which only an embedding model may have."""
    spec, config, st = context.spec, folder.config, folder.st
    if st is not None and st.dense and not projection:
        raise ValueError(f"{folder.path}: Dense modules apply to embedding models only")
    default_pooling = PoolingType.LAST if is_decoder(config) else PoolingType.CLS
    dims = tuple(getattr(config, "matryoshka_dimensions", None) or ())
    hidden = int(config.hidden_size)
    ranges = _calibration_ranges(folder.path, fields["tasks"], hidden)
    base: dict[str, Any] = {
        "hidden_size": projection[-1].out_features if projection else hidden,
        "projected": bool(projection),
        "num_special_tokens": folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        "pooling_type": spec.pooling_type or (st.pooling_type if st else None) or default_pooling,
        "default_normalize": st.normalize if st else True,
        "activation": classifier_activation(config),
        "is_matryoshka": bool(getattr(config, "is_matryoshka", False) or dims),
        "matryoshka_dimensions": dims,
        "include_prompt": st.include_prompt if st else True,
        "calibration_ranges": ranges,
        "calibration_source": FOLDER if ranges is not None else "",
    }
    return model_facts(folder, context, module, **{**base, **fields})


def config_labels(config: PretrainedConfig) -> tuple[str, ...]:
    """A classifier's labels by id, as its config names them."""
    return tuple(str(config.id2label[i]) for i in range(config.num_labels))


def serve_module(
    folder: ModelFolder,
    context: LoadContext,
    module: torch.nn.Module,
    info: ModelInfo,
    projection: Sequence[DenseLayer] = (),
    calibrate: bool = True,
    pool_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> LoadedModel:
    """A family's module (on the device) with its facts, served: the forward chosen among
    the backends its family runs on (torch, or an export), its int8 ranges and CUDA graphs.
    `calibrate`: compute int8 ranges where the folder ships none (not for a module whose
    pooled rows hold more than the embedding). `pool_logits`: the family's own pooling of
    per-token logits (ModelRunner's)."""
    spec, device = context.spec, context.device
    attn_implementation, runtime = context.attn_implementation, context.runtime
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
        pool_logits=pool_logits,
    )
    del module  # the runner holds it; an export that replaces it lets it go
    choose_forward(folder, runner, context, info.family)
    if calibrate:
        runner.info = with_computed_ranges(spec, folder, runner, attn_implementation, runtime)
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


def dense_projection(folder: ModelFolder, device: torch.device) -> list[DenseLayer]:
    """sentence-transformers' Dense modules, in order, on the device (embedding models only)."""
    st = folder.st
    projection = [load_dense(dense).to(device) for dense in (st.dense if st else ())]
    if projection and folder.head is not HeadKind.HIDDEN:
        raise ValueError(f"{folder.path}: Dense modules apply to embedding models only")
    return projection
