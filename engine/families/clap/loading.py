"""Loading a CLAP model (transformers' ClapModel folder with its ClapProcessor): both
towers on torch, the text tower through get_text_features and the audio tower through the
folder's ClapFeatureExtractor (mel features from the front ends' waveforms) and
get_audio_features. Imported only where models load."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import ClapFeatureExtractor, ClapModel

from pooling_server.engine.backends import BackendKind
from pooling_server.engine.families import LoadContext
from pooling_server.engine.families.clap import LABEL_TEMPLATE
from pooling_server.engine.families.clap.audio import AudioFrames, AudioSettings, read_settings
from pooling_server.engine.families.towers.runner import TowersRunner
from pooling_server.engine.families.towers.settings import TowerSettings
from pooling_server.engine.inputs.modality import Frame, Modality
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
from pooling_server.engine.requests.params import Task

log = logging.getLogger(__name__)


def read(folder: ModelFolder) -> AudioSettings | None:
    """A ClapModel folder: its feature extractor's rate and clip length."""
    if getattr(folder.config, "model_type", "") != "clap":
        return None
    settings = read_settings(folder.path)
    if settings is None:
        raise ValueError(
            f"{folder.path}: a CLAP folder needs its feature extractor's config "
            "(preprocessor_config.json or processor_config.json, as ClapProcessor saves it)"
        )
    return settings


def load(folder: ModelFolder, reading: object, context: LoadContext) -> LoadedModel:
    """The model on the device with both towers warm; its info lists text and audio."""
    assert isinstance(reading, AudioSettings)
    spec, device, dtype = context.spec, context.device, context.dtype
    _check_backend(spec)
    template = spec.label_template or LABEL_TEMPLATE
    if "{label}" not in template:
        raise ValueError(
            f'model {spec.served_name}: --label-template must hold "{{label}}", where each '
            f"candidate label goes; got {template!r}"
        )
    module = ClapModel.from_pretrained(folder.path, config=folder.config, dtype=dtype)
    module = module.to(device).eval()
    extractor = ClapFeatureExtractor.from_pretrained(folder.path)
    if int(extractor.sampling_rate) != reading.rate:
        raise ValueError(f"{folder.path}: the feature extractor's settings disagree")
    maximum = max_input_tokens(folder.config.text_config, folder.hf_tokenizer, None)
    tokenizer = ModelTokenizer(folder.tokenizer.spec, maximum)
    audio_config = folder.config.audio_config
    # What one clip costs in a batch: the audio tower's patches over its spectrogram image.
    cost = (int(audio_config.spec_size) // int(audio_config.patch_stride)) ** 2
    settings = TowerSettings(
        family="clap",
        # Zero-shot reads logits_per_audio: the audio side's temperature.
        logit_scale=float(module.logit_scale_a.detach().float().item()),
        logit_bias=None,
        image_size=(0, 0),
        patches=cost,
        text_mask=True,
        folder=str(folder.path),
        label_template=template,
    )
    long_input = spec.long_input
    if long_input is LongInput.CHUNK:
        log.warning("model %s: --long-input chunk does not apply to CLAP models", spec.name)
        long_input = LongInput.REJECT
    info = ModelInfo(
        **served_fields(spec, folder, module, context.is_default),
        family="clap",
        architecture=(folder.config.architectures or ["ClapModel"])[0],
        head=HeadKind.TOWERS,
        tasks=(Task.EMBED, Task.SCORE, Task.CLASSIFY),  # classify: zero-shot over labels
        hidden_size=int(folder.config.projection_dim),
        max_input_tokens=maximum,
        num_special_tokens=folder.hf_tokenizer.num_special_tokens_to_add(pair=False),
        pooling_type=PoolingType.CLS,  # unused: each tower pools as the model does
        default_normalize=True,  # as get_*_features return them
        activation=Activation.SOFTMAX,
        long_input=long_input,
        prompts=folder.prompts,
        default_prompt_name=folder.default_prompt_name,
        backend=str(BackendKind.TORCH),
        precision=str(dtype).removeprefix("torch."),
        modalities=(Modality.TEXT.value, Modality.AUDIO.value),
        settings=settings,
    )
    clips = AudioFrames(reading, cost)
    runner = TowersRunner(module, info, tokenizer.pad_token_id, device)
    runner.frame_tower = AudioTower(module, extractor, device)
    runner.warm_up_batch = [*tokenizer.tokenize(["warm up"]), clips.blank()]
    log.info(
        "model %s: CLAP towers on torch %s, %d dimensions, %g s clips at %d Hz",
        info.name,
        info.precision,
        info.hidden_size,
        reading.clip_seconds,
        reading.rate,
    )
    return LoadedModel(info, tokenizer, runner, images=clips)


class AudioTower:
    """The frames' waveforms through the folder's ClapFeatureExtractor, one clip per call
    as the zero-shot-audio-classification pipeline calls it (so that "fusion"'s is_longer
    is the clip's own, not drawn at random over a batch), then get_audio_features over the
    batch."""

    def __init__(self, module: Any, extractor: ClapFeatureExtractor, device: torch.device):
        self.module = module
        self.extractor = extractor
        self.device = device
        self.dtype = next(module.parameters()).dtype

    def __call__(self, batch: Sequence[Frame], threads: int | None) -> np.ndarray:
        rate = self.extractor.sampling_rate
        features = [self.extractor(frame.pixels, sampling_rate=rate) for frame in batch]
        mels = np.stack([np.asarray(f["input_features"][0]) for f in features])
        longer = np.array([f["is_longer"][0] for f in features], dtype=bool)
        output = self.module.get_audio_features(
            input_features=torch.from_numpy(mels).to(self.device, dtype=self.dtype),
            is_longer=torch.from_numpy(longer).to(self.device),
        )
        tensor = output if isinstance(output, torch.Tensor) else output.pooler_output
        return tensor.float().cpu().numpy()  # type: ignore[no-any-return]


def _check_backend(spec: Any) -> None:
    """Both towers run on torch: an export (--backend onnx/openvino, --backend-file) or
    --quantize is refused, as for any family whose module no export follows."""
    options, name = spec.backend, spec.served_name
    if (
        options.file
        or options.quantize
        or options.kind
        not in (
            BackendKind.AUTO,
            BackendKind.TORCH,
        )
    ):
        raise ValueError(
            f"model {name}: a CLAP model runs both towers on torch; leave --backend auto or "
            "torch, and --backend-file and --quantize unset"
        )
