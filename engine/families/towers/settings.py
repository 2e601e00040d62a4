"""A two-tower model's settings (torch-free: every front end reads them in
ModelInfo.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from pooling_server.engine.requests.label_rules import DEFAULT_LABEL_TEMPLATE


@dataclass(frozen=True)
class TowerSettings:
    """A two-tower model's settings, read from its folder at load: an image-text model's
    (CLIP, SigLIP), or another modality's beside text (CLAP's audio).

    Zero-shot logits are exp(logit_scale) * cosine (+ logit_bias, SigLIP's), turned into
    probabilities by softmax over the labels (CLIP, CLAP) or a sigmoid each (SigLIP)."""

    family: str  # "clip" or "siglip" (SigLIP and SigLIP 2), "clap"
    logit_scale: float  # the model's learned log temperature, before exp()
    logit_bias: float | None  # SigLIP's; None for CLIP
    image_size: tuple[int, int]  # (height, width) the processor resizes to
    patches: int  # what one image costs in a batch's token budget
    # Texts padded to this many tokens as the model was trained (SigLIP: max_length);
    # 0: to the longest in the batch, with an attention mask (CLIP).
    text_length: int = 0
    text_mask: bool = True  # whether the model's tokenizer makes an attention mask
    folder: str = ""  # where the image processor's config lives, for every front end
    label_template: str = DEFAULT_LABEL_TEMPLATE  # zero-shot's default (--label-template)
