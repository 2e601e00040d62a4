"""Models with their own modeling code, --revision, and the loader's prompt settings.

A local folder whose config.json `auto_map` points at a .py file in the folder (a BertModel
subclass of a model type transformers does not know) loads only with --trust-remote-code;
without it the loader, and so the server, refuses with a message naming the flag.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertModel

from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.service.cli import build_parser, model_specs
from tests.fixture_models import MINILM, _bert_config, _save, _sentence_transformers_layout
from tests.server_process import start_server

MODELING = '''
from transformers import BertConfig, BertModel


class TinyCustomConfig(BertConfig):
    model_type = "tiny-custom-bert"


class TinyCustomModel(BertModel):
    """BertModel whose token states come out doubled plus one: proof the code ran."""

    config_class = TinyCustomConfig

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        output = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            **kwargs,
        )
        output.last_hidden_state = output.last_hidden_state * 2 + 1
        return output
'''
TEXTS = ["Hello world", "custom code, loaded on trust"]


def _module(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("modeling_tiny_custom", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def custom_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("custom-code")
    source = root / "modeling_tiny_custom.py"
    source.write_text(MODELING)
    module = _module(source)
    torch.manual_seed(2)
    config = module.TinyCustomConfig(**_bert_config().to_diff_dict())
    folder = root / "tiny-custom"
    module.TinyCustomModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    shutil.copy(source, folder / source.name)
    config_file = folder / "config.json"
    saved = json.loads(config_file.read_text())
    saved["auto_map"] = {
        "AutoConfig": "modeling_tiny_custom.TinyCustomConfig",
        "AutoModel": "modeling_tiny_custom.TinyCustomModel",
    }
    config_file.write_text(json.dumps(saved))
    return folder


def load(spec: ModelSpec) -> LoadedModel:
    return load_model(spec, device=torch.device("cpu"), dtype=torch.float32)


def embed(model: LoadedModel, texts: list[str]) -> np.ndarray:
    request = PoolRequest(task=Task.EMBED, texts=tuple(texts))
    plan = plan_request(request, model)
    raws = model.runner.forward([e for e, _ in plan.work], [k for _, k in plan.work])
    return np.stack([o.values for o in plan.finish(raws)])  # type: ignore[union-attr]


def test_custom_code_loads_with_trust_remote_code(
    custom_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pooling_server.engine.models.loader"):
        model = load(ModelSpec(str(custom_folder), name="custom", trust_remote_code=True))
    assert any("--trust-remote-code is on" in r.getMessage() for r in caplog.records)
    assert type(model.runner.module).__name__ == "TinyCustomModel"
    assert model.info.architecture == "TinyCustomModel"
    assert (model.info.dtype, model.info.device, model.info.revision) == ("float32", "cpu", "")
    # The reference: the folder's own class, CLS pooling, L2-normalised.
    reference = _module(custom_folder / "modeling_tiny_custom.py").TinyCustomModel
    module = reference.from_pretrained(custom_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(custom_folder)
    with torch.inference_mode():
        states = module(**tokenizer(TEXTS, padding=True, return_tensors="pt")).last_hidden_state
    expected = torch.nn.functional.normalize(states[:, 0], dim=-1).numpy()
    np.testing.assert_allclose(embed(model, TEXTS), expected, rtol=0, atol=1e-5)


def test_custom_code_is_refused_without_trust_remote_code(custom_folder: Path) -> None:
    with pytest.raises(ValueError, match="--trust-remote-code") as caught:
        load(ModelSpec(str(custom_folder), name="custom"))
    assert "modeling_tiny_custom.TinyCustomModel" in str(caught.value)


def test_server_refuses_to_start_without_trust_remote_code(
    custom_folder: Path, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError) as caught:
        start_server(["--model", f"custom={custom_folder}"], tmp_path)
    log = str(caught.value)
    assert "model custom:" in log
    assert "runs only with --trust-remote-code" in log


def test_revision_on_a_local_folder_is_ignored(
    model_folders: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pooling_server.engine.models.loader"):
        model = load(ModelSpec(str(model_folders["tiny-bert"]), revision="v1.0"))
    assert model.info.revision == ""
    assert any("--revision v1.0 is ignored" in r.getMessage() for r in caplog.records)


def _prompt_folder(root: Path, config: dict[str, object]) -> Path:
    folder = _save(BertModel(_bert_config()), root)
    _sentence_transformers_layout(folder, "mean", normalize=True)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    return folder


def test_default_prompt_name_must_name_a_prompt(tmp_path: Path) -> None:
    prompts = {"query": "query: ", "passage": "passage: "}
    folder = _prompt_folder(tmp_path / "a", {"prompts": prompts, "default_prompt_name": "query"})
    assert load(ModelSpec(str(folder))).info.default_prompt_name == "query"
    overridden = load(ModelSpec(str(folder), default_prompt_name="passage")).info
    assert (overridden.prompts, overridden.default_prompt_name) == (prompts, "passage")
    assert load(ModelSpec(str(folder), default_prompt_name="")).info.default_prompt_name is None
    with pytest.raises(ValueError, match='--default-prompt-name "document" is not one of'):
        load(ModelSpec(str(folder), name="m", default_prompt_name="document"))
    broken = _prompt_folder(tmp_path / "b", {"prompts": prompts, "default_prompt_name": "doc"})
    with pytest.raises(ValueError, match='default_prompt_name "doc" is not one of'):
        load(ModelSpec(str(broken)))


def test_cli_per_model_flags() -> None:
    argv = ["--model", "a=/x", "--model", "b=/y", "--default-prompt-name", "auto"]
    argv += ["--default-prompt-name", "", "--revision", "", "--revision", "v2"]
    argv += ["--long-input", "truncate", "--trust-remote-code"]
    args = build_parser().parse_args(argv)
    a, b = model_specs(args)
    assert (a.default_prompt_name, b.default_prompt_name) == (None, "")
    assert (a.revision, b.revision) == (None, "v2")
    assert a.trust_remote_code and b.trust_remote_code
    assert a.long_input == b.long_input == "truncate"
    assert not model_specs(build_parser().parse_args(["--model", "/x"]))[0].trust_remote_code
