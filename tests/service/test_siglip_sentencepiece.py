"""SigLIP as Google publishes it: `spiece.model` and SiglipTokenizer, no tokenizer.json
(issue 43). The engine tokenizes with Rust `tokenizers`, so the slow SentencePiece
tokenizer is converted at load (engine/models/model_folder.py's fast_tokenizer) and checked
against itself; the folder is served by a real server, its vectors equal to transformers'
get_text_features / get_image_features, which tokenize with the slow tokenizer.

The SentencePiece model is trained here, on generated text, with sentencepiece's own
trainer; the towers are random-weight, saved with save_pretrained."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import torch
from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipTokenizer

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.model_folder import PROBES, fast_tokenizer
from tests.fixture_models import IMAGE_SIZE, SIGLIP_TEXT_LENGTH, _tower_configs
from tests.service.http_calls import HttpServer, http_stub, serve_models
from tests.service.test_images_served import DECODED, IMAGES, Towers, image_item, text_item

ATOL = 2e-4
MODEL = "siglip-spm"
SYLLABLES = ["ka", "to", "mi", "ra", "ne", "so", "lu", "vi", "de", "po", "an", "el", "or", "us"]
WORDS = ["a", "photo", "of", "the", "cat", "dog", "red", "car", "on", "road", "café", "東京"]
# Texts that the slow tokenizer canonicalises: case, punctuation, runs of white space.
TEXTS = [
    "a photo of a cat",
    "A Photo, of THE dog!!",
    "  a red\tcar\non a road  ",
    "Café, 東京 & kapo-mira's 'road'",
    "",
]


def _corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = WORDS + [
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(lines)]


def siglip_as_google_ships(folder: Path) -> Path:
    """A random-weight SiglipModel beside a SentencePiece (Unigram) model trained on
    generated text, saved as SigLIP's checkpoints are: spiece.model and a tokenizer_config
    naming SiglipTokenizer, with "</s>" its end and padding token."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(3000)),
        model_writer=model,
        vocab_size=300,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    folder.mkdir(parents=True)
    (folder / "spiece.model").write_bytes(model.getvalue())
    tokenizer = SiglipTokenizer(str(folder / "spiece.model"), model_max_length=SIGLIP_TEXT_LENGTH)
    tokenizer.save_pretrained(folder)
    text, vision = _tower_configs(SIGLIP_TEXT_LENGTH)
    text.update(vocab_size=tokenizer.vocab_size, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(3)
    siglip = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    with torch.no_grad():
        siglip.logit_scale.fill_(2.3)
        siglip.logit_bias.fill_(-1.5)
    siglip.save_pretrained(folder)
    SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = siglip_as_google_ships(tmp_path_factory.mktemp("siglip-spm") / "model")
    assert not (built / "tokenizer.json").exists()
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "SiglipTokenizer"
    return built


@pytest.fixture(scope="module")
def http(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from serve_models(tmp_path_factory, "siglip-spm", {MODEL: folder})


stub = http_stub


def test_the_converted_tokenizer_equals_the_slow_one(folder: Path) -> None:
    """The slow SiglipTokenizer is what transformers loads; the engine's fast form of it
    gives the same ids on the probes and on 2,000 generated texts of words, capitals,
    punctuation, white space of every kind, accents, CJK and SentencePiece's word mark."""
    slow = SiglipTokenizer.from_pretrained(folder)
    fast = fast_tokenizer(slow, folder)
    assert fast is not slow and fast.backend_tokenizer is not None
    rng = random.Random(5)
    pieces = [*WORDS, "Photo", "CAT", " ", "  ", "\t", "\n", "\u3000", "\u00a0", ",", ".", "!"]
    pieces += ["'", "-", "(", ")", "\u2581", "é", "ß", "ﬁ", "ｆ", "3", "kato", "MIRA"]
    texts = [*PROBES, *TEXTS]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(2000)]
    for text in texts:
        assert fast(text)["input_ids"] == slow(text)["input_ids"], repr(text)


def test_a_conversion_that_disagrees_is_refused(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fast form that tokenizes any probe otherwise is not served: the load fails naming
    the folder, the tokenizer and the text."""
    import pooling_server.engine.models.model_folder as model_folder

    slow = SiglipTokenizer.from_pretrained(folder)
    real = model_folder._convert

    def careless(tokenizer: object) -> object:
        backend = real(tokenizer)
        backend.normalizer = None  # neither lower case nor punctuation dropped
        return backend

    monkeypatch.setattr(model_folder, "_convert", careless)
    with pytest.raises(ValueError, match=r"SiglipTokenizer.*converted.*tokenizes") as caught:
        fast_tokenizer(slow, folder)
    assert str(folder) in str(caught.value)


def test_served_texts_and_images_equal_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub, folder: Path
) -> None:
    """Texts (tokenized by transformers with the slow SiglipTokenizer, padded to the
    model's length) and images, embedded by the server: transformers' get_text_features
    and get_image_features, normalised."""
    towers = Towers(folder)
    assert type(towers.tokenizer).__name__ == "SiglipTokenizer"
    items = [text_item(text) for text in TEXTS] + [image_item(data) for data in IMAGES]
    response = stub.Pool(pb.PoolRequest(model=MODEL, embed=pb.TextInput(items=items)))
    got = np.array([list(e.values) for e in response.embed.embeddings])
    expected = np.concatenate([towers.text(TEXTS), towers.image(DECODED)])
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_served_zero_shot_equals_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub, folder: Path
) -> None:
    """Labels through the converted tokenizer, scored as SigLIP's logits are (sigmoid)."""
    towers = Towers(folder)
    labels = ["Cat!", "dog", "a RED car"]
    given = pb.TextInput(items=[image_item(IMAGES[0])], candidate_labels=labels)
    response = stub.Pool(pb.PoolRequest(model=MODEL, classify=given))
    logits = towers.logits_per_image(DECODED[:1], [f"a photo of a {x}." for x in labels])
    got = [list(c.probs) for c in response.classify.classifications]
    np.testing.assert_allclose(got, logits.sigmoid().numpy(), atol=ATOL)
