"""Loading a two-tower image-text model: CLIP, SigLIP or SigLIP 2, from a transformers
folder or sentence-transformers' CLIP layout.

The text tower runs on torch (get_text_features), the image tower on the backend asked for
(engine/backends/image_tower.py: torch's get_image_features, or its export); the image
processor named by the folder runs in the front ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel

from pooling_server.engine.backends import BackendKind, RuntimeSettings
from pooling_server.engine.backends.export import TowerSource
from pooling_server.engine.backends.image_tower import load_image_tower
from pooling_server.engine.backends.registry import REGISTRY
from pooling_server.engine.families.towers import image_preprocessor
from pooling_server.engine.families.towers.runner import ImageTower, TowersRunner
from pooling_server.engine.families.towers.settings import TowerSettings
from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.inputs.tokenization import ModelTokenizer
from pooling_server.engine.models.model_folder import ModelFolder, max_input_tokens, served_fields
from pooling_server.engine.models.model_info import (
    Activation,
    HeadKind,
    LongInput,
    ModelInfo,
    PoolingType,
)
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.encodings import read_calibration_ranges
from pooling_server.engine.requests.params import Task

log = logging.getLogger(__name__)

# --backend auto keeps both towers on torch: it exports no image tower.
AUTO_TOWER = {BackendKind.AUTO: BackendKind.TORCH}


def load_towers(
    spec: ModelSpec,
    folder: ModelFolder,
    device: torch.device,
    dtype: torch.dtype,
    is_default: bool,
    runtime: RuntimeSettings | None = None,
    threads: int = 1,
) -> LoadedModel:
    """The model on the device with both towers warm; its info lists both modalities.
    `runtime` and `threads`: an exported image tower's cache and cores."""
    kind = _image_backend_kind(spec, device, dtype)
    config = folder.config
    if REGISTRY[kind].exported and config.model_type == "siglip2":
        raise ValueError(
            f"model {spec.served_name}: --backend {kind} exports a fixed-size image "
            "tower; SigLIP 2's NaFlex towers (Siglip2Model, variable resolution) run on "
            "torch: pass --backend torch"
        )
    template = spec.label_template or TowerSettings.label_template
    if "{label}" not in template:
        raise ValueError(
            f'model {spec.served_name}: --label-template must hold "{{label}}", where each '
            f"candidate label goes; got {template!r}"
        )
    module = AutoModel.from_pretrained(folder.path, config=config, dtype=dtype, **folder.hub)
    module = module.to(device).eval()
    text_config = config.get_text_config()
    st_max = folder.st.max_seq_length if folder.st else None
    maximum = max_input_tokens(text_config, folder.hf_tokenizer, st_max)
    tokenizer = ModelTokenizer(folder.tokenizer.spec, maximum)
    family = "clip" if config.model_type == "clip" else "siglip"
    settings = TowerSettings(
        family=family,
        logit_scale=float(module.logit_scale.detach().float().item()),
        logit_bias=(
            float(module.logit_bias.detach().float().item()) if family == "siglip" else None
        ),
        image_size=(0, 0),
        patches=0,
        # SigLIP was trained on texts padded to the tokenizer's max_length, and pools the
        # last position: its processor pads every text so, and so must the engine.
        text_length=maximum if family == "siglip" else 0,
        text_mask="attention_mask" in folder.hf_tokenizer.model_input_names,
        folder=str(folder.path),
        label_template=template,
    )
    st = folder.st
    long_input = spec.long_input
    if long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to image models", spec.name)
        long_input = LongInput.REJECT
    info = ModelInfo(
        **served_fields(spec, folder, module, is_default),
        family="towers",
        architecture=(config.architectures or [type(module).__name__])[0],
        head=HeadKind.TOWERS,
        tasks=(Task.EMBED, Task.SCORE, Task.CLASSIFY),  # classify: zero-shot over labels
        hidden_size=0,  # the towers' shared width, measured below
        max_input_tokens=maximum,
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.CLS,  # unused: each tower pools as the model does
        # A transformers folder: normalised, as the model's own logits compare its
        # features; sentence-transformers' layout: as its modules say (clip-ViT-B-32 has
        # no Normalize module, so encode() returns the raw features).
        default_normalize=st.normalize if st is not None else True,
        activation=Activation.SOFTMAX if family == "clip" else Activation.SIGMOID,
        long_input=long_input,
        prompts=folder.prompts,
        default_prompt_name=folder.default_prompt_name,
        backend=str(BackendKind.TORCH),
        precision=str(dtype).removeprefix("torch."),
        modalities=(Modality.TEXT.value, Modality.IMAGE.value),
        settings=settings,
    )
    processor = image_preprocessor(info)
    settings = _with_processor(settings, processor)
    warm_up: list[Any] = list(tokenizer.tokenize(["warm up"]))
    warm_up.append(processor.blank())
    runner = TowersRunner(module, _replace(info, settings=settings), tokenizer.pad_token_id, device)
    tower = TowerSource(spec.served_name, folder.path, module, device, settings.image_size)
    backend = load_image_tower(kind, tower, runtime, threads)
    runner.frame_tower = ImageTower(backend, naflex=config.model_type == "siglip2")
    file = backend.file
    info = _replace(info, backend=str(kind), backend_file=str(file) if file else "")
    width = int(runner.forward(warm_up[:1], [False])[0].shape[-1])
    ranges = read_calibration_ranges(Path(folder.path), width)
    info = _replace(info, settings=settings, hidden_size=width, calibration_ranges=ranges)
    runner.info = info
    runner.warm_up_batch = warm_up
    log.info(
        "model %s: %s towers on torch %s, %d dimensions, images %dx%d (%d patches)",
        info.name,
        family,
        info.precision,
        width,
        *settings.image_size,
        settings.patches,
    )
    return LoadedModel(info, tokenizer, runner, images=processor)


def _with_processor(settings: TowerSettings, processor: Any) -> TowerSettings:
    height, width = processor.size
    return _replace(settings, image_size=(int(height), int(width)), patches=int(processor.patches))


def _replace(value: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(value, **changes)


def _image_backend_kind(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> BackendKind:
    """Where the image tower runs: --backend onnx or openvino moves it to an export of its
    own (CPU, float32); auto and torch keep both towers on torch. A shipped --backend-file
    (one forward: a text model's) and --quantize are refused."""
    options = spec.backend
    name = spec.served_name
    if options.file:
        raise ValueError(
            f"model {name}: --backend-file holds one forward; an image model (CLIP, SigLIP) "
            "exports its image tower itself: leave --backend-file unset"
        )
    if options.quantize:
        raise ValueError(
            f"model {name}: --quantize does not apply to an image model (CLIP, SigLIP)"
        )
    kind = AUTO_TOWER.get(options.kind, options.kind)
    if not REGISTRY[kind].runs_here(device, dtype):
        raise ValueError(
            f"model {name}: --backend {options.kind} runs the image tower in float32 on the "
            f"CPU, not {str(dtype).removeprefix('torch.')} on {device}; pass --device cpu or "
            "--backend torch"
        )
    return kind
