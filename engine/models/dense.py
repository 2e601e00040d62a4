"""sentence-transformers' Dense modules: projections of the pooled vector, after pooling.

A folder such as LaBSE or distiluse lists `Dense` modules between Pooling and Normalize;
each is a linear layer, an activation and optionally a residual. They run on the device
right after pooling, in float32, so embed and score see the projected vector (as
sentence-transformers' `encode` does) and token_embed the transformer's token states.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


class DenseLayer(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        activation: torch.nn.Module,
        use_residual: bool,
    ) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        self.use_residual = use_residual
        if use_residual and in_features != out_features:
            self.residual = torch.nn.Linear(in_features, out_features, bias=False)
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


def load_dense(folder: Path) -> DenseLayer:
    """One Dense module folder: its config.json and weights (safetensors or torch)."""
    config = json.loads((folder / "config.json").read_text())
    source = config.get("module_input_name", "sentence_embedding")
    if source != "sentence_embedding" or config.get("module_output_name") not in (
        None,
        "sentence_embedding",
    ):
        raise ValueError(f"{folder}: only Dense modules on the sentence embedding are supported")
    layer = DenseLayer(
        int(config["in_features"]),
        int(config["out_features"]),
        bool(config.get("bias", True)),
        _activation(folder, config.get("activation_function", "torch.nn.modules.activation.Tanh")),
        bool(config.get("use_residual", False)),
    )
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
    layer.load_state_dict(
        {key: value for key, value in weights.items() if key.split(".")[0] != "activation"},
        strict=False,
    )
    missing = {"linear.weight"} - set(weights)
    if missing:
        raise ValueError(f"{folder}: the Dense weights lack {sorted(missing)}")
    return layer.float().eval()


def _activation(folder: Path, name: str | None) -> torch.nn.Module:
    """A torch.nn activation named by its import path, as sentence-transformers saves it;
    other code is not imported (it would run whatever the folder names)."""
    if name is None:
        return torch.nn.Identity()
    module_name, _, class_name = name.rpartition(".")
    if not module_name.startswith("torch."):
        raise ValueError(f"{folder}: Dense activation {name!r} is not a torch.nn module")
    activation = getattr(importlib.import_module(module_name), class_name)
    return activation()
