"""Image models (two towers: CLIP, SigLIP, SigLIP 2's NaFlex) on tiny random-weight folders:
embeddings equal to transformers' get_image_features / get_text_features through the model's
own processor (SigLIP 2: images of mixed aspect ratios in one batch) and to
sentence-transformers' encode on its CLIP layout, text-image scores, zero-shot
probabilities equal to the model's logits softmaxed (CLIP) or sigmoid'd (SigLIP), mixed
text and image batches (in one forward pass and through the queue), and the refusals."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.outputs import Classification, Embedding, ItemOutput
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import Image, Item, PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request, validate_rerank
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.engine.scheduling.engine import Engine
from tests.engine.planned import load, run_all
from tests.fixture_models import (
    MINILM,
    tiny_clip,
    tiny_siglip,
    tiny_siglip2,
    tiny_st6_clip,
    tiny_st_clip,
)

ATOL = 2e-4  # our Pillow/numpy preprocessing against transformers' own processor
TEXTS = ["a photo of a cat", "two dogs playing in the snow, on a sunny winter day", "x"]
LABELS = ("cat", "dog", "red car")


def picture(seed: int, size: tuple[int, int] = (40, 48)) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8), "RGB")


def encoded(image: PILImage.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


# One of each format; the references decode the same bytes (JPEG is lossy).
FORMATS = ("PNG", "JPEG", "WEBP")
IMAGES = [Image(encoded(picture(k), fmt)) for k, fmt in enumerate(FORMATS)]
DECODED = [PILImage.open(io.BytesIO(image.data)).convert("RGB") for image in IMAGES]
# Aspect ratios that give SigLIP 2's processor different patch grids (4x4, 2x6, 8x2, 3x5
# of at most 16): one batch pads them to its longest.
SHAPES = ((40, 48), (8, 24), (64, 16), (30, 50))
MIXED = [Image(encoded(picture(10 + k, size), "PNG")) for k, size in enumerate(SHAPES)]
MIXED_DECODED = [PILImage.open(io.BytesIO(image.data)).convert("RGB") for image in MIXED]
TOWERS = ["clip", "siglip", "siglip2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images")
    clip = tiny_clip(root / "clip")
    return {
        "clip": clip,
        "siglip": tiny_siglip(root / "siglip"),
        "siglip2": tiny_siglip2(root / "siglip2"),
        "st-clip": tiny_st_clip(root / "st-clip", clip),
        "st6-clip": tiny_st6_clip(root / "st6-clip", clip),
    }


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, LoadedModel]:
    loaded = {name: load(folder, name) for name, folder in folders.items()}
    loaded["minilm"] = load(MINILM, "minilm")
    return loaded


class Reference:
    """The transformers model with its own tokenizer and image processor."""

    def __init__(self, folder: Path) -> None:
        self.model = AutoModel.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder)
        self.siglip = self.model.config.model_type in ("siglip", "siglip2")

    def text_inputs(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        if self.siglip:  # as SigLIP's processor: padded to max_length
            return self.tokenizer(
                list(texts),
                padding="max_length",
                max_length=self.model.config.text_config.max_position_embeddings,
                return_tensors="pt",
            )
        return self.tokenizer(list(texts), padding=True, return_tensors="pt")

    def pixels(self, images: Sequence[PILImage.Image]) -> dict[str, torch.Tensor]:
        """pixel_values, and for SigLIP 2 its pixel_attention_mask and spatial_shapes."""
        return dict(self.processor(images=list(images), return_tensors="pt"))

    @torch.inference_mode()
    def text(self, texts: Sequence[str]) -> np.ndarray:
        return _rows(self.model.get_text_features(**self.text_inputs(texts)))

    @torch.inference_mode()
    def image(self, images: Sequence[PILImage.Image]) -> np.ndarray:
        return _rows(self.model.get_image_features(**self.pixels(images)))

    @torch.inference_mode()
    def logits_per_image(
        self, images: Sequence[PILImage.Image], texts: Sequence[str]
    ) -> np.ndarray:
        inputs = dict(self.text_inputs(texts))
        output = self.model(**inputs, **self.pixels(images))
        return output.logits_per_image.numpy()


def _rows(output: object) -> np.ndarray:
    tensor = output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]
    return tensor.float().numpy()


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(folders[name]) for name in TOWERS}


def embed(items: Sequence[Item], normalize: bool | None = None) -> PoolRequest:
    return PoolRequest(
        Task.EMBED, params=PoolingParams(use_activation=normalize), items=tuple(items)
    )


def vectors(outputs: Sequence[ItemOutput]) -> np.ndarray:
    return np.stack([o.values for o in outputs if isinstance(o, Embedding)])


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def embeds_as_encode(model: LoadedModel, folder: Path) -> None:
    """A sentence-transformers CLIP layout without a Normalize module: embed's default
    gives the raw features, as the folder's SentenceTransformer encode() does."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu")
    assert not model.info.default_normalize
    [out] = run_all(model, [embed([*TEXTS, *IMAGES])])
    expected = np.concatenate([reference.encode(list(TEXTS)), reference.encode(list(DECODED))])
    np.testing.assert_allclose(vectors(out), expected, atol=ATOL)


@pytest.mark.parametrize("name", TOWERS)
def test_model_card(models: dict[str, LoadedModel], name: str) -> None:
    info = models[name].info
    assert info.modalities == ("text", "image")
    # SigLIP 2: a square image's size at its most patches (4x4 of 4 pixels)
    size = (16, 16) if name == "siglip2" else (32, 32)
    assert info.accepts_media and info.settings.image_size == size
    assert info.settings.patches == (17 if name == "clip" else 16)  # CLIP adds its class token
    assert info.hidden_size == (24 if name == "clip" else 32)
    assert set(info.tasks) == {Task.EMBED, Task.SCORE, Task.CLASSIFY}
    assert models["minilm"].info.modalities == ("text",)


@pytest.mark.parametrize("name", TOWERS)
def test_embeddings_equal_the_towers_features(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """Texts and images mixed in one request, in one pass: each row the tower's own
    features (use_activation false), or them normalised (the default)."""
    model, reference = models[name], references[name]
    items: list[Item] = [TEXTS[0], IMAGES[0], IMAGES[1], TEXTS[1], IMAGES[2], TEXTS[2]]
    raw, normed = run_all(model, [embed(items, False), embed(items)])
    texts, images = reference.text(TEXTS), reference.image(DECODED)
    expected = np.stack([texts[0], images[0], images[1], texts[1], images[2], texts[2]])
    np.testing.assert_allclose(vectors(raw), expected, atol=ATOL)
    np.testing.assert_allclose(vectors(normed), unit(expected), atol=ATOL)
    modalities = [o.modality for o in raw]  # type: ignore[union-attr]
    assert modalities == [
        Modality.TEXT,
        *[Modality.IMAGE] * 2,
        Modality.TEXT,
        Modality.IMAGE,
        Modality.TEXT,
    ]


def test_siglip2_mixed_sizes_in_one_batch(
    models: dict[str, LoadedModel], references: dict[str, Reference]
) -> None:
    """Images of four aspect ratios in one forward pass, each its own patch grid padded to
    the batch's longest and masked: each equals get_image_features through SigLIP 2's
    processor (which pads to max_num_patches), and costs its own patch count."""
    from pooling_server.engine.families.towers.towers import prepare

    model, reference = models["siglip2"], references["siglip2"]
    grids = reference.pixels(MIXED_DECODED)["spatial_shapes"].tolist()
    assert len({tuple(grid) for grid in grids}) == 4  # four different grids
    request = embed([*MIXED, TEXTS[0]], False)
    resolved = validate_request(request, model.info, Limits())
    frames = prepare(resolved, model, Limits(), request.items[:4], "embed.items")
    assert [list(frame.pixels.shape[:2]) for frame in frames] == grids
    assert [len(frame) for frame in frames] == [rows * cols for rows, cols in grids]
    [out] = run_all(model, [request])
    expected = np.concatenate([reference.image(MIXED_DECODED), reference.text(TEXTS[:1])])
    np.testing.assert_allclose(vectors(out), expected, atol=ATOL)


def test_texts_without_items_embed_through_the_text_tower(
    models: dict[str, LoadedModel], references: dict[str, Reference]
) -> None:
    [out] = run_all(models["clip"], [PoolRequest(Task.EMBED, texts=tuple(TEXTS))])
    np.testing.assert_allclose(vectors(out), unit(references["clip"].text(TEXTS)), atol=ATOL)


def test_sentence_transformers_clip_layout(
    models: dict[str, LoadedModel], folders: dict[str, Path]
) -> None:
    """clip-ViT-B-32's layout: no Normalize module, so encode() returns raw features, and
    so does embed by default."""
    embeds_as_encode(models["st-clip"], folders["st-clip"])


def test_sentence_transformers_6_clip_layout(
    models: dict[str, LoadedModel], folders: dict[str, Path]
) -> None:
    """What sentence-transformers 6 saves for CLIP (processor_config.json, a root
    Transformer module) loads, and embeds as its encode() does."""
    assert (folders["st6-clip"] / "processor_config.json").is_file()
    assert not (folders["st6-clip"] / "preprocessor_config.json").exists()
    embeds_as_encode(models["st6-clip"], folders["st6-clip"])


@pytest.mark.parametrize("name", TOWERS)
def test_scores_are_cosines_of_both_towers(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """Text-image (1:N), image-image (N:N) and text-text pairs, by cosine."""
    model, reference = models[name], references[name]
    texts, images = unit(reference.text(TEXTS)), unit(reference.image(DECODED))
    requests = [
        PoolRequest(Task.SCORE, items_1=(TEXTS[0],), items_2=tuple(IMAGES)),
        PoolRequest(Task.SCORE, items_1=tuple(IMAGES), items_2=tuple(reversed(IMAGES))),
        PoolRequest(Task.SCORE, text_1=(TEXTS[0],), text_2=(TEXTS[1],)),
        PoolRequest(Task.SCORE, text_1=(TEXTS[0],), items_2=tuple(IMAGES)),  # sides differ
    ]
    one_n, n_n, plain, mixed = (
        np.array([s.value for s in out]) for out in run_all(model, requests)
    )  # type: ignore[union-attr]
    np.testing.assert_allclose(one_n, images @ texts[0], atol=ATOL)
    np.testing.assert_allclose(n_n, np.sum(images * images[::-1], axis=1), atol=ATOL)
    np.testing.assert_allclose(plain, [texts[0] @ texts[1]], atol=ATOL)
    np.testing.assert_allclose(mixed, one_n, atol=ATOL)


@pytest.mark.parametrize("name", TOWERS)
def test_zero_shot_equals_the_models_logits(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """CLIP: softmax of logits_per_image over the labels' prompts; SigLIP: each sigmoid'd
    (its logit_bias included). use_activation false gives the logits themselves."""
    model, reference = models[name], references[name]
    prompts = [f"a photo of a {label}." for label in LABELS]
    logits = reference.logits_per_image(DECODED, prompts)
    expected = (
        torch.sigmoid(torch.from_numpy(logits))
        if name != "clip"
        else torch.from_numpy(logits).softmax(-1)
    ).numpy()
    request = PoolRequest(Task.CLASSIFY, items=tuple(IMAGES), candidate_labels=LABELS)
    raw = PoolRequest(
        Task.CLASSIFY,
        items=tuple(IMAGES),
        candidate_labels=LABELS,
        params=PoolingParams(use_activation=False),
    )
    probs, plain = run_all(model, [request, raw])
    got = np.stack([c.probs for c in probs])  # type: ignore[union-attr]
    np.testing.assert_allclose(got, expected, atol=ATOL)
    np.testing.assert_allclose(np.stack([c.probs for c in plain]), logits, atol=ATOL * 50)  # type: ignore[union-attr]
    for c, row in zip(probs, expected, strict=True):
        assert isinstance(c, Classification) and c.modality is Modality.IMAGE
        assert c.label == LABELS[int(np.argmax(row))]


def test_label_template(models: dict[str, LoadedModel], references: dict[str, Reference]) -> None:
    template = "an image showing {label}"
    logits = references["clip"].logits_per_image(
        DECODED[:1], [template.format(label=x) for x in LABELS]
    )
    request = PoolRequest(
        Task.CLASSIFY, items=(IMAGES[0],), candidate_labels=LABELS, label_template=template
    )
    [[out]] = run_all(models["clip"], [request])
    np.testing.assert_allclose(
        out.probs, torch.from_numpy(logits[0]).softmax(-1).numpy(), atol=ATOL
    )  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["clip", "siglip2"])
def test_rerank_with_image_documents(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """Through the engine and its queue: a text query against image and text documents,
    ranked by cosine, each result with its document's modality; the queue keeps the
    towers' batches apart."""
    model, reference = models[name], references[name]
    documents: tuple[Item, ...] = (IMAGES[0], TEXTS[1], IMAGES[1], IMAGES[2])

    async def body(engine: Engine) -> tuple[object, object]:
        rerank = engine.rerank(RerankRequest(TEXTS[0], (), items=documents))
        pooled = engine.pool(embed([TEXTS[2], IMAGES[2]]))
        return await asyncio.gather(rerank, pooled)

    async def main() -> tuple[object, object]:
        engine = Engine([model], batch_config=BatchConfig())
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), 60)
        finally:
            await engine.stop()

    ranked, pooled = asyncio.run(main())
    query = unit(reference.text(TEXTS[:1]))[0]
    images = unit(reference.image(DECODED))
    expected = [
        images[0] @ query,
        unit(reference.text(TEXTS[1:2]))[0] @ query,
        images[1] @ query,
        images[2] @ query,
    ]
    order = np.argsort(-np.array(expected), kind="stable")
    assert [r.index for r in ranked.ranking] == order.tolist()  # type: ignore[attr-defined]
    np.testing.assert_allclose(
        [r.score for r in ranked.ranking], np.array(expected)[order], atol=ATOL
    )  # type: ignore[attr-defined]
    modalities = [r.modality for r in ranked.ranking]  # type: ignore[attr-defined]
    assert modalities == [
        Modality.TEXT if documents[i] is TEXTS[1] else Modality.IMAGE for i in order
    ]
    assert [o.modality for o in pooled.outputs] == [Modality.TEXT, Modality.IMAGE]  # type: ignore[attr-defined]


# ---- refusals


def refusal(model: LoadedModel, request: PoolRequest, limits: Limits | None = None) -> PoolingError:
    limits = limits or Limits()
    with pytest.raises(PoolingError) as caught:
        plan_request(validate_request(request, model.info, limits), model, limits)
    return caught.value


def reasons(error: PoolingError) -> list[tuple[str, str]]:
    return [(v.field, v.reason) for v in error.violations]


def test_images_to_a_text_only_model(models: dict[str, LoadedModel]) -> None:
    error = refusal(models["minilm"], embed(["a text", IMAGES[0]]))
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    assert reasons(error) == [("embed.items[1].image", "MODALITY_NOT_SUPPORTED")]
    error = refusal(
        models["minilm"], PoolRequest(Task.CLASSIFY, texts=("a",), candidate_labels=LABELS)
    )
    assert reasons(error) == [("classify", "TASK_NOT_SUPPORTED")]  # MiniLM does not classify


def test_item_shape_refusals(models: dict[str, LoadedModel]) -> None:
    clip = models["clip"]
    both = PoolRequest(Task.EMBED, texts=("a",), items=(IMAGES[0],))
    assert reasons(refusal(clip, both)) == [("embed.texts", "ITEMS_AND_TEXTS")]
    token = PoolRequest(Task.TOKEN_EMBED, items=(IMAGES[0],))
    assert reasons(refusal(clip, token)) == [("token_embed.items", "ITEMS_NOT_SUPPORTED_FOR_TASK")]
    labels_on_embed = PoolRequest(Task.EMBED, items=(IMAGES[0],), candidate_labels=LABELS)
    assert reasons(refusal(clip, labels_on_embed)) == [
        ("classify.candidate_labels", "CANDIDATE_LABELS_NOT_SUPPORTED_FOR_TASK")
    ]
    no_labels = PoolRequest(Task.CLASSIFY, items=(IMAGES[0],))
    assert reasons(refusal(clip, no_labels)) == [
        ("classify.candidate_labels", "CANDIDATE_LABELS_MISSING")
    ]
    bad_template = PoolRequest(
        Task.CLASSIFY, items=(IMAGES[0],), candidate_labels=LABELS, label_template="a photo"
    )
    assert reasons(refusal(clip, bad_template)) == [
        ("classify.label_template", "LABEL_TEMPLATE_INVALID")
    ]
    blank = PoolRequest(Task.CLASSIFY, items=(IMAGES[0],), candidate_labels=("cat", " "))
    assert reasons(refusal(clip, blank)) == [
        ("classify.candidate_labels[1]", "CANDIDATE_LABEL_EMPTY")
    ]
    shape = PoolRequest(Task.SCORE, items_1=IMAGES[:2], items_2=tuple(IMAGES))
    assert reasons(refusal(clip, shape)) == [("score.items_2", "SCORE_SHAPE_MISMATCH")]


def test_too_many_images(models: dict[str, LoadedModel]) -> None:
    limits = Limits(max_images_per_request=2)
    error = refusal(models["clip"], embed(["a", *IMAGES]), limits)
    assert reasons(error) == [("embed.items", "TOO_MANY_IMAGES")]


def test_a_bad_image_names_its_path(models: dict[str, LoadedModel]) -> None:
    corrupt = Image(IMAGES[0].data[:40])  # a PNG cut short
    error = refusal(models["clip"], embed(["a", IMAGES[1], corrupt]))
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert reasons(error) == [("embed.items[2].image", "IMAGE_INVALID")]
    score = PoolRequest(Task.SCORE, items_1=("a",), items_2=(IMAGES[0], Image(b"not an image")))
    assert reasons(refusal(models["clip"], score)) == [("score.items_2[1].image", "IMAGE_INVALID")]


def test_rerank_paths(models: dict[str, LoadedModel]) -> None:
    request = RerankRequest("q", (), items=(IMAGES[0], "doc"))
    text_model = models["minilm"].info
    with pytest.raises(PoolingError) as caught:
        validate_rerank(request, text_model, Limits())
    assert reasons(caught.value) == [("items[0].image", "MODALITY_NOT_SUPPORTED")]


@pytest.mark.parametrize("name", ["siglip", "siglip2"])
def test_images_through_an_engine_process_link(
    models: dict[str, LoadedModel], references: dict[str, Reference], tmp_path: Path, name: str
) -> None:
    """The split path: a front end built from the engine's description (its own image
    processor) sends pixel frames over the link as raw float32 beside the token ids, and
    gets the same vectors back as the in-process engine computes. SigLIP 2's frames (each
    its own patch grid) carry their grid in their shape."""
    from pooling_server.engine.models.served import ModelDescription
    from pooling_server.engine.scheduling.core import EngineCore
    from pooling_server.engine.scheduling.ipc import EngineReady
    from pooling_server.engine.scheduling.remote_client import RemoteEngineClient

    model = models[name]
    images, decoded = (MIXED, MIXED_DECODED) if name == "siglip2" else (IMAGES, DECODED)
    items: list[Item] = [images[0], TEXTS[0], images[1], images[2], TEXTS[1]]

    async def main() -> list[ItemOutput]:
        core = EngineCore([model], BatchConfig(), str(tmp_path / "engine.sock"))
        await core.start()
        serving = asyncio.create_task(core.serve())
        description = ModelDescription(model.info, model.tokenizer.spec)
        front = description.served()
        assert model.info.accepts_media and front.images is not None
        assert front.images.size == model.info.settings.image_size
        client = RemoteEngineClient([EngineReady(core.address, 0, [description])])
        engine = Engine([front], client=client)
        await engine.start()
        try:
            result = await asyncio.wait_for(engine.pool(embed(items, False)), 60)
            return result.outputs
        finally:
            await engine.stop()
            serving.cancel()
            await core.stop()

    outputs = asyncio.run(main())
    texts, pictures = references[name].text(TEXTS), references[name].image(decoded[:3])
    expected = np.stack([pictures[0], texts[0], pictures[1], pictures[2], texts[1]])
    np.testing.assert_allclose(vectors(outputs), expected, atol=ATOL)
    assert [o.modality for o in outputs][:2] == [Modality.IMAGE, Modality.TEXT]  # type: ignore[union-attr]


def test_the_servers_label_template(
    folders: dict[str, Path], references: dict[str, Reference]
) -> None:
    """--label-template: the default prompt of a model's zero-shot labels (per model, from
    the flags), which a request's label_template still overrides."""
    from pooling_server.service.cli import config_from_args, parse_args

    template = "a blurry picture of {label}"
    argv = ["--model", f"clip={folders['clip']}", "--label-template", template]
    [spec] = config_from_args(parse_args(argv, environ={})).models
    assert spec.label_template == template
    model = load_model(spec, device=torch.device("cpu"), dtype=torch.float32)
    assert model.info.accepts_media and model.info.settings.label_template == template
    logits = references["clip"].logits_per_image(
        DECODED[:1], [template.format(label=x) for x in LABELS]
    )
    request = PoolRequest(Task.CLASSIFY, items=(IMAGES[0],), candidate_labels=LABELS)
    [[out]] = run_all(model, [request])
    expected = torch.from_numpy(logits[0]).softmax(-1).numpy()
    np.testing.assert_allclose(out.probs, expected, atol=ATOL)  # type: ignore[union-attr]


def test_load_refusals(folders: dict[str, Path]) -> None:
    """A shipped export holds one forward (not two towers), --quantize does not apply, and
    the template must place the label."""
    from pooling_server.engine.backends import BackendKind, BackendOptions, Quantize

    shipped = BackendOptions(kind=BackendKind.ONNX, file="model.onnx")
    for options, match in (
        (shipped, "leave --backend-file unset"),
        (BackendOptions(kind=BackendKind.ONNX, quantize=Quantize.INT8), "--quantize"),
    ):
        spec = ModelSpec(str(folders["clip"]), backend=options)
        with pytest.raises(ValueError, match=match):
            load_model(spec, device=torch.device("cpu"), dtype=torch.float32)
    bad = ModelSpec(str(folders["clip"]), label_template="a photo")
    with pytest.raises(ValueError, match="--label-template must hold"):
        load_model(bad, device=torch.device("cpu"), dtype=torch.float32)


def test_siglip2_on_an_exported_backend_is_refused_by_name(folders: dict[str, Path]) -> None:
    """An exported image tower takes one fixed image size; SigLIP 2's runs on torch."""
    from pooling_server.engine.backends import BackendKind, BackendOptions

    spec = ModelSpec(str(folders["siglip2"]), backend=BackendOptions(kind=BackendKind.ONNX))
    with pytest.raises(ValueError, match=r"NaFlex.*--backend torch"):
        load_model(spec, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("kind", ["onnx", "openvino"])
def test_image_tower_on_a_cpu_backend(
    folders: dict[str, Path], references: dict[str, Reference], tmp_path: Path, kind: str
) -> None:
    """--backend onnx / openvino: the image tower exported (cached), within the text
    backends' tolerance of transformers; the text tower stays on torch."""
    from pooling_server.engine.backends import BackendKind, BackendOptions, RuntimeSettings

    spec = ModelSpec(str(folders["clip"]), backend=BackendOptions(kind=BackendKind(kind)))
    model = load_model(
        spec,
        device=torch.device("cpu"),
        dtype=torch.float32,
        runtime=RuntimeSettings(cache_dir=tmp_path),
    )
    assert model.info.backend == kind and model.info.backend_file.endswith("image_tower.onnx")
    [out] = run_all(model, [embed([IMAGES[0], TEXTS[0], IMAGES[1]], False)])
    reference = references["clip"]
    expected = np.stack(
        [*reference.image(DECODED[:1]), *reference.text(TEXTS[:1]), *reference.image(DECODED[1:2])]
    )
    np.testing.assert_allclose(vectors(out), expected, atol=1e-4)


def test_zero_shot_answers_are_bounded(models: dict[str, LoadedModel]) -> None:
    """A zero-shot answer holds one value per candidate label for every item: refused before
    any image is decoded when that would pass the door's limit."""
    from pooling_server.engine.requests.output_size import ResponseBudget

    labels = tuple(f"label {k}" for k in range(1000))
    request = PoolRequest(Task.CLASSIFY, items=(IMAGES[0],) * 30, candidate_labels=labels)
    small = Limits(response=ResponseBudget(max_bytes=100_000))
    assert reasons(refusal(models["clip"], request, small)) == [
        ("classify.items", "OUTPUT_TOO_LARGE")
    ]


def test_batches_hold_one_tower(folders: dict[str, Path]) -> None:
    """Texts and images queued together form batches of one tower each, an image costing
    its patch count in the token budget."""
    from pooling_server.engine.inputs.modality import is_image

    model = load(folders["clip"])
    batches: list[list[bool]] = []
    forward = model.runner.forward

    def recording(batch: Sequence[object], keep: Sequence[bool], alone: bool = True) -> list:
        batches.append([is_image(unit) for unit in batch])
        return forward(batch, keep, alone)  # type: ignore[arg-type]

    model.runner.forward = recording  # type: ignore[method-assign]
    requests = [embed([TEXTS[k % 3], IMAGES[k % 3], IMAGES[(k + 1) % 3]]) for k in range(12)]

    async def main() -> list[object]:
        engine = Engine([model], batch_config=BatchConfig(max_batch_tokens=17 * 8))
        await engine.start()
        batches.clear()  # the warm-up's mixed batch is the runner's, not the queue's
        try:
            return await asyncio.wait_for(asyncio.gather(*map(engine.pool, requests)), 60)
        finally:
            await engine.stop()

    results = asyncio.run(main())
    assert len(results) == 12 and batches
    assert all(len(set(kinds)) == 1 for kinds in batches)
    assert max(len(kinds) for kinds in batches if kinds[0]) <= 8  # 8 images of 17 patches
    assert sum(map(len, batches)) == 36
