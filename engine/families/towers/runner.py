"""A two-tower model's forward: texts through the text tower (get_text_features, on torch),
every other input (a Frame: an image, an audio clip) through the model's frame tower, each
tower once for its part of the batch (the queue forms batches of one tower; a mixed one,
the warm-up's, runs both). Shared by every two-tower family: CLIP and SigLIP set an image
tower here, CLAP its audio tower."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import Backend
from pooling_server.engine.backends.torch_backend import features
from pooling_server.engine.inputs.modality import Frame, is_frame
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.model_runner import ModelRunner

# Frames in, one float32 row each out; `threads`: the pass's share of the cores.
FrameTower = Callable[[Sequence[Frame], int | None], np.ndarray]


class TowersRunner(ModelRunner):
    """A ModelRunner whose forward is two towers'; `frame_tower` is set where the family
    loads (towers_loader.py's ImageTower, CLAP's audio tower)."""

    def __init__(
        self,
        module: torch.nn.Module,
        info: ModelInfo,
        pad_token_id: int,
        device: torch.device,
        frame_tower: FrameTower | None = None,
    ) -> None:
        super().__init__(module, info, pad_token_id, device)
        self.frame_tower = frame_tower

    @torch.inference_mode()
    def _forward(
        self, batch: Sequence[Any], keep_tokens: Sequence[bool], threads: int | None
    ) -> list[np.ndarray]:
        assert self.frame_tower is not None
        outputs: list[np.ndarray] = [None] * len(batch)  # type: ignore[list-item]
        texts = [i for i, e in enumerate(batch) if not is_frame(e)]
        frames = [i for i, e in enumerate(batch) if is_frame(e)]
        for positions, tower in ((texts, self._text_tower), (frames, self.frame_tower)):
            if positions:
                rows = tower([batch[i] for i in positions], threads)
                for i, row in zip(positions, rows, strict=True):
                    outputs[i] = row
        return outputs

    def _text_tower(self, batch: Sequence[TokenSequence], threads: int | None) -> np.ndarray:
        """Padded as the model's processor pads (SigLIP: to its fixed length), with the
        attention mask only where its tokenizer makes one."""
        settings = self.info.settings
        assert settings is not None and self.module is not None
        arrays = self.arrays(batch)
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
        missing = settings.text_length - ids.shape[1]
        if missing > 0:
            ids = np.pad(ids, ((0, 0), (0, missing)), constant_values=self.pad_token_id)
            mask = np.pad(mask, ((0, 0), (0, missing)))
        inputs = {"input_ids": torch.from_numpy(ids).to(self.device)}
        if settings.text_mask:
            inputs["attention_mask"] = torch.from_numpy(mask).to(self.device)
        return features(self.module.get_text_features(**inputs))


class ImageTower:
    """Images through the image tower's backend (engine/backends/image_tower.py: torch's
    get_image_features, or its export): fixed-size pixels stacked, or SigLIP 2's patches
    (each frame [rows, cols, patch values], `naflex`)."""

    def __init__(self, backend: Backend, naflex: bool) -> None:
        self.backend = backend
        self.naflex = naflex

    def __call__(self, batch: Sequence[Frame], threads: int | None) -> np.ndarray:
        if self.naflex:
            arrays = _naflex_arrays(batch)
        else:
            arrays = {"pixel_values": np.stack([frame.pixels for frame in batch])}
        return self.backend.run(self.backend.feed(arrays), threads)  # type: ignore[no-any-return]


def _naflex_arrays(batch: Sequence[Frame]) -> dict[str, np.ndarray]:
    """SigLIP 2's variable-resolution tower: each image's patches in a row, padded to the
    batch's longest, with the mask over the real ones and each image's grid (the processor
    pads to max_num_patches; the mask makes the padding's length moot)."""
    longest = max(len(frame) for frame in batch)
    width = batch[0].pixels.shape[-1]
    pixels = np.zeros((len(batch), longest, width), np.float32)
    mask = np.zeros((len(batch), longest), np.int64)
    shapes = np.zeros((len(batch), 2), np.int64)
    for i, frame in enumerate(batch):
        rows, cols, _ = frame.pixels.shape
        pixels[i, : rows * cols] = frame.pixels.reshape(rows * cols, width)
        mask[i, : rows * cols] = 1
        shapes[i] = (rows, cols)
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}
